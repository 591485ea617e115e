"""``ascend-adapters status``: what serves here and how.

Installed versions, the engine against the supported range, the ``vllm.general_plugins``
entry points, the kernel dispatch path, which class serves each adapter architecture
(native first), the admission settings and, for a model directory, which quantization
method will serve it. Every section answers even when its source fails.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def status(model_dir: str | None = None) -> dict:
    """Installed versions, ``vllm.general_plugins`` entry points, kernel path, admission settings,
    which class serves each adapter architecture (native first) and, for ``model_dir``, which
    quantization method will serve it."""
    import importlib.metadata as md

    from ascend_adapters.common.admission import hook
    from ascend_adapters.common.versions import engine_distribution, installed_details

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
        from ascend_adapters.common.platform import kernel_path

        path = kernel_path().value
    except Exception as exc:  # status must always answer
        path = f"unknown ({type(exc).__name__}: {exc})"
    from ascend_adapters.common.compat import engine_status

    engine = engine_distribution()
    try:
        from ascend_adapters.common.registry import serving_report

        serving = serving_report()
    except Exception as exc:  # status must always answer
        serving = [{"arch": None, "serves": "unknown", "target": None, "why": f"{type(exc).__name__}: {exc}"}]
    quant = None
    if model_dir is not None:
        from ascend_adapters.common.quant.detect import quant_decision

        try:
            config = json.loads((Path(model_dir) / "config.json").read_text())
        except (OSError, ValueError) as exc:
            config = {}
            quant = {"model_dir": model_dir, "method": None, "why": f"config.json unreadable ({exc})"}
        if quant is None:
            method, why = quant_decision(model_dir, config)
            quant = {"model_dir": model_dir, "method": method, "why": why}
    return {
        "serving": serving,
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
    lines.append("architectures (native first):")
    for r in st.get("serving") or []:
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
    st = status(getattr(args, "model", None))
    print(json.dumps(st, indent=2) if args.json else format_status(st))
    return 0


def add_parsers(subparsers) -> None:
    p = subparsers.add_parser(
        "status", help="installed versions, vllm.general_plugins entry points, kernel dispatch path"
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--model", metavar="DIR", help="also say which quantization method will serve this export, and why")
    p.set_defaults(func=cmd_status)
