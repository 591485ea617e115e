"""Problems found by admission checks, and the report that collects them."""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class Problem:
    """One finding. ``where`` names the file, tensor or manifest field at fault."""

    code: str
    where: str
    message: str
    severity: str = "error"  # "error" fails admission; "note" is informational

    def __str__(self) -> str:
        tag = "ERROR" if self.severity == "error" else "note"
        return f"{tag} [{self.code}] {self.where}: {self.message}"


@dataclasses.dataclass
class Report:
    """Everything found about one model directory."""

    model_dir: str = ""
    problems: list[Problem] = dataclasses.field(default_factory=list)
    stats: dict = dataclasses.field(default_factory=dict)

    def error(self, code: str, where: str, message: str) -> None:
        self.problems.append(Problem(code, where, message))

    def note(self, code: str, where: str, message: str) -> None:
        self.problems.append(Problem(code, where, message, severity="note"))

    def extend(self, other: Report) -> None:
        self.problems.extend(other.problems)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def notes(self) -> list[Problem]:
        return [p for p in self.problems if p.severity != "error"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def summary_line(self) -> str:
        if self.ok:
            files = self.stats.get("files", 0)
            size = self.stats.get("bytes", 0)
            tensors = self.stats.get("tensors", 0)
            hashed = "sha256 verified" if self.stats.get("hashed") else "sha256 NOT verified (--no-hash)"
            return f"OK {self.model_dir}: {files} files, {size / 2**20:.1f} MiB, {tensors} tensors, {hashed}" + (
                f", {len(self.notes)} note(s)" if self.notes else ""
            )
        return f"REFUSED {self.model_dir}: {len(self.errors)} problem(s)"

    def format(self) -> str:
        lines = [self.summary_line()]
        lines += [f"  {p}" for p in self.errors]
        lines += [f"  {p}" for p in self.notes]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(
            {
                "model_dir": self.model_dir,
                "ok": self.ok,
                "problems": [dataclasses.asdict(p) for p in self.problems],
                "stats": self.stats,
            },
            indent=2,
        )


class AdmissionError(RuntimeError):
    """Raised when a model directory is refused; carries the report."""

    def __init__(self, report: Report):
        super().__init__(report.format())
        self.report = report
