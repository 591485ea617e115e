"""``ascend-adapters status``: what serves here and how.

Installed versions, the engine against the supported range, the ``vllm.general_plugins``
entry points, the kernel dispatch path, which class serves each adapter architecture
(native first), the admission settings and, for a model directory, which quantization
method will serve it. Every section answers even when its source fails.

With ``--model DIR``, ``DIR/config.json`` is read first: a directory without a readable JSON
object there is refused (exit status 2, one line naming the file). Only the model's own
architectures are shown, and vLLM is imported only where the answer needs it: when the model's
architecture is one of the installed adapters' (who serves it depends on the platform: native
first) or it is a ModelSlim export (which method reads it depends on the platform too). For any
other model the answer comes from package metadata and the directory alone, in well under 3 s.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


class ModelDirError(ValueError):
    """``status --model DIR``: DIR has no readable ``config.json`` object; the message names the file."""


def read_model_config(model_dir: str | os.PathLike) -> dict:
    """``DIR/config.json`` as a dict, or ``ModelDirError`` naming the file and what is wrong with it."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ModelDirError(f"{model_dir}: not a directory")
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelDirError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ModelDirError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelDirError(f"{path}: not a JSON object (a {type(config).__name__})")
    return config


def adapter_architectures() -> dict[str, str]:
    """Architecture -> hook module of every installed adapter, from the hooks' ``ARCHITECTURES`` (the hook
    modules are cheap to import: vLLM imports them in every process; nothing of vLLM or torch is imported)."""
    import importlib
    import importlib.metadata as md

    out: dict[str, str] = {}
    for ep in md.entry_points(group="vllm.general_plugins"):
        module_name = ep.value.split(":")[0]
        if not module_name.startswith("ascend_adapters.") or module_name.startswith("ascend_adapters.common"):
            continue
        try:
            archs = getattr(importlib.import_module(module_name), "ARCHITECTURES", {})
        except Exception:  # the full report (serving_report) names a broken hook
            continue
        for arch in archs:
            out.setdefault(arch, module_name)
    return out


def _model_architectures(config: dict) -> list[str]:
    archs = config.get("architectures")
    return [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []


def _needs_engine(model_dir: str | os.PathLike, config: dict, archs: list[str], ours: dict[str, str]) -> bool:
    """Whether the answer for this model depends on the vLLM platform (native first, ModelSlim hand-off)."""
    from ascend_adapters.common.quant.description import DESCRIPTION_FILE

    if any(a in ours for a in archs):
        return True
    return config.get("quantization_config") is None and (Path(model_dir) / DESCRIPTION_FILE).is_file()


def _quant_without_engine(config: dict) -> tuple[str | None, str]:
    """``quant.detect.quant_decision``'s answer where it needs no platform (the config has a
    ``quantization_config``, or the directory holds no ModelSlim description), in the same words; that
    function imports vLLM for its method name (a test keeps the two in step)."""
    from ascend_adapters.common.quant.description import DESCRIPTION_FILE

    existing = config.get("quantization_config")
    if existing is not None:
        method = existing.get("quant_method") if isinstance(existing, dict) else None
        return method or None, f"config.json has a quantization_config (quant_method {method!r}): left as it is"
    return None, f"no {DESCRIPTION_FILE}: not a ModelSlim export"


def _row_not_ours(arch: str | None, ours: dict[str, str]) -> dict:
    from ascend_adapters.common.registry import NATIVE

    if arch is None:
        return {
            "arch": None,
            "adapter": None,
            "serves": "unknown",
            "target": None,
            "why": "config.json names no architectures",
        }
    known = ", ".join(sorted(ours)) or "none installed"
    return {
        "arch": arch,
        "adapter": None,
        "serves": NATIVE,
        "target": None,
        "why": f"not an architecture of the installed adapters ({known}): vLLM or the platform serves it with its own class",
    }


def _kernel_path() -> str:
    """The kernel dispatch path; without a ``torch_npu`` to import it is the portable one (answered without
    importing torch, as ``platform.kernel_path`` would after failing to import torch_npu)."""
    import importlib.util

    if importlib.util.find_spec("torch_npu") is None:
        return "portable"
    from ascend_adapters.common.platform import kernel_path

    return kernel_path().value


def status(model_dir: str | None = None) -> dict:
    """Installed versions, ``vllm.general_plugins`` entry points, kernel path, admission settings,
    which class serves each adapter architecture (native first) and, for ``model_dir``, which
    quantization method will serve it.

    ``serving`` lists every adapter architecture when vLLM was consulted, else None (``model_dir`` names
    a model no adapter serves, which needs no engine). With ``model_dir``, ``model`` holds the model's
    ``architectures`` and their rows (``model.serving``). Raises ``ModelDirError`` when ``model_dir`` has
    no readable ``config.json`` object.
    """
    import importlib.metadata as md

    from ascend_adapters.common.admission import hook
    from ascend_adapters.common.versions import engine_distribution, installed_details

    config = read_model_config(model_dir) if model_dir is not None else None
    plugins = []
    for ep in md.entry_points(group="vllm.general_plugins"):
        dist = getattr(ep, "dist", None)
        plugins.append(
            {
                "name": ep.name,
                "value": ep.value,
                "distribution": f"{dist.metadata['Name']} {dist.version}" if dist is not None else None,
            }
        )
    try:
        path = _kernel_path()
    except Exception as exc:  # status must always answer
        path = f"unknown ({type(exc).__name__}: {exc})"
    from ascend_adapters.common.compat import engine_status

    engine = engine_distribution()
    ours = adapter_architectures()
    archs = _model_architectures(config) if config is not None else []
    serving = None
    if config is None or _needs_engine(model_dir, config, archs, ours):
        try:
            from ascend_adapters.common.registry import serving_report

            serving = serving_report()
        except Exception as exc:  # status must always answer
            serving = [{"arch": None, "serves": "unknown", "target": None, "why": f"{type(exc).__name__}: {exc}"}]
    quant = model = None
    if config is not None:
        if serving is None:
            method, why = _quant_without_engine(config)
        else:
            from ascend_adapters.common.quant.detect import quant_decision

            method, why = quant_decision(model_dir, config)
        quant = {"model_dir": model_dir, "method": method, "why": why}
        by_arch = {r["arch"]: r for r in serving or [] if r.get("arch")}
        rows = [by_arch.get(a) or _row_not_ours(a, ours) for a in archs] or [_row_not_ours(None, ours)]
        model = {"model_dir": model_dir, "architectures": archs, "serving": rows}
    return {
        "serving": serving,
        "model": model,
        "quantization": quant,
        "versions": installed_details(),
        "engine_distribution": engine[0] if engine else None,
        "engine": engine_status(),
        "general_plugins": sorted(plugins, key=lambda p: p["name"]),
        "kernel_path": path,
        "admission": {
            hook.MANIFEST_ENV: os.environ.get(hook.MANIFEST_ENV) or None,
            hook.MODEL_DIR_ENV: os.environ.get(hook.MODEL_DIR_ENV) or None,
            hook.HASH_ENV: os.environ.get(hook.HASH_ENV) or None,
        },
    }


def format_status(st: dict) -> str:
    lines = ["installed versions:"]
    for key, info in st["versions"].items():
        lines.append(f"  {key:<13} {info['version'] + '  (' + info['source'] + ')' if info else 'not installed'}")
    eng = st["engine"]
    verdict = {True: "inside", False: "OUTSIDE", None: "no engine installed;"}[eng["in_range"]]
    override = eng["override"]
    override_text = "on" if override is True else "off" if override is False else override
    lines.append(
        f"engine: {eng['distribution'] or 'vllm'} {eng['version'] or '(not installed)'}, {verdict} the supported range "
        f"{eng['supported_range']} (tested on {', '.join(eng['tested_releases'])}); {eng['override_env']}: "
        f"{override_text}" + (" (start-up is refused)" if eng["in_range"] is False and override is not True else "")
    )
    lines.append("vllm.general_plugins entry points:")
    for p in st["general_plugins"] or []:
        lines.append(f"  {p['name']:<28} {p['value']:<50} [{p['distribution']}]")
    if not st["general_plugins"]:
        lines.append("  (none)")
    lines.append(f"kernel dispatch path: {st['kernel_path']}")
    model = st.get("model")
    if model:
        lines.append(f"architectures of {model['model_dir']} (native first):")
    else:
        lines.append("architectures (native first):")
    for r in (model["serving"] if model else st.get("serving")) or []:
        lines.append(f"  {r['arch']}: {r['serves']} {r['target'] or ''} ({r['why']})")
        cap = r.get("capabilities")
        if cap:
            pp = cap["pipeline_parallel"]
            pp_text = {True: "supported (SupportsPP)", False: "not supported"}.get(pp, pp)
            spec = ", ".join(cap["speculative_methods"]) or "none (refused at start-up)"
            lines.append(f"    pipeline parallelism: {pp_text}; speculative decoding: {spec}")
            lines.append(f"    graph mode: {_graph_mode(cap)}")
        lines.extend(f"    {note}" for note in r.get("notes") or [])
    q = st.get("quantization")
    if q:
        lines.append(f"quantization of {q['model_dir']}: {q['method'] or 'none from this project'} ({q['why']})")
    adm = st["admission"]
    enabled = adm["ASCEND_ADAPTERS_MANIFEST"]
    lines.append(f"serve-time admission: {'enabled, manifest ' + enabled if enabled else 'disabled'}")
    for k, v in adm.items():
        if v and k != "ASCEND_ADAPTERS_MANIFEST":
            lines.append(f"  {k}={v}")
    return "\n".join(lines)


def _graph_mode(cap: dict) -> str:
    compiled = cap.get("compiled_classes")
    if not compiled:
        return "eager (no class of the model is under vLLM's @support_torch_compile)"
    if isinstance(compiled, str):
        return compiled
    ops = ", ".join(cap.get("splitting_ops") or []) or "none"
    return (
        f"compiled by vLLM unless --enforce-eager (@support_torch_compile on {', '.join(compiled)}); "
        f"run eagerly between the compiled pieces: {ops}"
    )


def cmd_status(args) -> int:
    try:
        st = status(getattr(args, "model", None))
    except ModelDirError as exc:
        print(f"ascend-adapters status: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(st, indent=2) if args.json else format_status(st))
    return 0


def add_parsers(subparsers) -> None:
    p = subparsers.add_parser(
        "status", help="installed versions, vllm.general_plugins entry points, kernel dispatch path"
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--model",
        metavar="DIR",
        help="only this model's architectures, and which quantization method will serve it and why "
        "(exit status 2 when DIR/config.json is missing or not a JSON object)",
    )
    p.set_defaults(func=cmd_status)
