"""Serve-time admission, called from common's ``vllm.general_plugins`` hook.

Enabled by ``ASCEND_ADAPTERS_MANIFEST=/path/to/manifest.json``. vLLM calls
general plugins in every process it starts; in ``vllm serve`` the first call
happens in the API server process while vLLM builds its argument parser, before
any model module is imported or any weight is read. That is where the full
check runs (sizes, headers, description, versions and sha256 of every file).

The model directory is taken from, in order: ``ASCEND_ADAPTERS_MODEL_DIR``;
the ``model`` of the ``EngineArgs`` being built (the ``vllm.LLM(...)`` path,
where plugins load in ``EngineArgs.__post_init__``); the command line
(``vllm serve DIR``, ``--model DIR``, ``--config FILE``); the directory a
parent process admitted.

A process that passed the full check exports a marker (manifest digest +
directory) to the processes vLLM starts later (model inspection, engine core,
workers); they re-run the cheap structural checks but do not hash again.

On failure the process exits non-zero (``EXIT_CODE``) after writing to stderr one line that names the
culprit (``ascend-adapters admission REFUSED the model (...): [code] where: why``), then, when there is
more than one problem, the full report.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

from ascend_adapters.common.flags import FlagError, env_flag

MANIFEST_ENV = "ASCEND_ADAPTERS_MANIFEST"
MODEL_DIR_ENV = "ASCEND_ADAPTERS_MODEL_DIR"
HASH_ENV = "ASCEND_ADAPTERS_ADMISSION_HASH"  # off skips sha256 at serve time (structure only)
ADMITTED_ENV = "ASCEND_ADAPTERS_ADMITTED"  # set by this module for child processes

EXIT_CODE = 3
# vLLM CLI invocations that load no model: admission has nothing to check there.
NO_MODEL_COMMANDS = frozenset({"chat", "complete", "collect-env", "--version", "-v", "--help", "-h"})
_admitted: tuple[str, str] | None = None


def _option(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _model_from_config_file(path: str) -> str | None:
    try:
        import yaml  # a vLLM dependency; without it a --config model is not found (fail closed)

        with open(path) as f:
            data = yaml.safe_load(f)
    except Exception:
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) and model else None


def model_dir_from_argv(argv: list[str]) -> str | None:
    """The model of ``vllm serve MODEL ...``, ``--model MODEL`` or ``--config FILE`` (``model:``), else None.

    When ``serve`` is followed by options first (``vllm serve --port 1 /m``), the one argument that is
    a directory holding a ``config.json`` is taken; several such directories are ambiguous (None).
    """
    rest = argv[1:]
    is_serve = "serve" in rest
    if is_serve:
        rest = rest[rest.index("serve") + 1 :]
    model = _option(rest, "--model")
    if model:
        return model
    if is_serve and rest and not rest[0].startswith("-"):
        return rest[0]
    config = _option(rest, "--config")
    if config and _model_from_config_file(config):
        return _model_from_config_file(config)
    if is_serve:
        dirs = {os.path.realpath(a): a for a in rest if not a.startswith("-") and os.path.isfile(f"{a}/config.json")}
        if len(dirs) == 1:
            return next(iter(dirs.values()))
    return None


def _model_from_engine_args() -> str | None:
    """``self.model`` of an ``EngineArgs`` under construction further up the stack."""
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if obj is not None and type(obj).__name__.endswith("EngineArgs"):
            model = getattr(obj, "model", None)
            if isinstance(model, str) and model:
                return model
        frame = frame.f_back
    return None


def refusal_line(culprit: str, more: int = 0) -> str:
    """The first line of a serve-time refusal: one line naming the culprit (file, tensor or field), so that it
    reads on its own above whatever vLLM prints after it."""
    extra = f" (+{more} more problem(s), listed below)" if more else ""
    return f"ascend-adapters admission REFUSED the model ({MANIFEST_ENV} is set): {culprit}{extra}"


def _fail(message: str, culprit: str | None = None, more: int = 0) -> None:
    """Refuse: one line naming ``culprit`` (default: ``message``'s first line), then the rest of the
    report, to stderr; exit with ``EXIT_CODE``."""
    lines = message.strip("\n").splitlines()
    if culprit is None:
        culprit, lines = (lines[0].strip().removeprefix("ERROR ") if lines else "refused"), lines[1:]
    body = "".join(f"{line}\n" for line in lines)
    sys.stderr.write(f"{refusal_line(culprit, more)}\n{body}")
    sys.stderr.flush()
    raise SystemExit(EXIT_CODE)


def _fail_report(report) -> None:
    errors = report.errors
    culprit = str(errors[0]).removeprefix("ERROR ") if errors else report.summary_line()
    _fail(report.format() if len(errors) > 1 else "", culprit, more=len(errors) - 1)


def admit_from_env() -> None:
    """Validate the model directory named by the environment; exit non-zero on failure. Idempotent."""
    global _admitted
    manifest_path = os.environ.get(MANIFEST_ENV, "").strip()
    if not manifest_path:
        return
    try:
        with open(manifest_path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except OSError as exc:
        _fail(f"  ERROR [manifest-unreadable] {manifest_path}: {exc}")
        return

    marker = None
    try:
        marker = json.loads(os.environ.get(ADMITTED_ENV, "") or "null")
    except ValueError:
        marker = None
    if not isinstance(marker, dict) or marker.get("manifest_sha256") != digest:
        marker = None

    model = (
        os.environ.get(MODEL_DIR_ENV, "").strip()
        or _model_from_engine_args()
        or model_dir_from_argv(sys.argv)
        or (marker or {}).get("model_dir")
    )
    if not model and (sys.argv[1:2] and sys.argv[1] in NO_MODEL_COMMANDS or "--help" in sys.argv):
        return
    if not model:
        _fail(
            f"  ERROR [model-dir-unknown] {MANIFEST_ENV}: cannot tell which model directory to check; "
            f"use `vllm serve DIR` or set {MODEL_DIR_ENV}"
        )
        return
    if not os.path.isdir(model):
        _fail(f"  ERROR [dir-missing] {model}: not a local model directory")
        return
    real = os.path.realpath(model)
    if _admitted == (digest, real):
        return

    from ascend_adapters.common.admission.checks import check_dir

    quick = marker is not None and marker.get("model_dir") == real and marker.get("full")
    try:
        hashes = not quick and env_flag(HASH_ENV, default=True)
    except FlagError as exc:
        _fail(f"  ERROR [flag] {exc}")
        return
    if not quick:
        what = "sha256 of every file" if hashes else f"no sha256 ({HASH_ENV}=0)"
        sys.stderr.write(f"ascend-adapters admission: checking {real} against {manifest_path} ({what})\n")
        sys.stderr.flush()
    report = check_dir(real, manifest_path, verify_hashes=hashes, progress=False)
    if not report.ok:
        _fail_report(report)
        return
    _admitted = (digest, real)
    if quick:
        sys.stderr.write(f"ascend-adapters admission: re-checked structure in pid {os.getpid()}: OK\n")
    else:
        os.environ[ADMITTED_ENV] = json.dumps({"manifest_sha256": digest, "model_dir": real, "full": True})
        sys.stderr.write(f"ascend-adapters admission: {report.summary_line()} (manifest {manifest_path})\n")
    sys.stderr.flush()
