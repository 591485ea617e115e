"""Human summaries: ``render DIR`` and ``status``."""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

from ascend_adapters.common.admission.checks import inspect_dir
from ascend_adapters.common.admission.description import summarize
from ascend_adapters.common.admission.report import Report


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def render_dir(model_dir: str) -> tuple[dict, Report]:
    """A summary dict of ``model_dir`` (identity, sizes, quant types, shards) and the problems seen."""
    report = Report(model_dir=model_dir)
    insp = inspect_dir(model_dir, report)
    if insp is None:
        return {"model_dir": model_dir}, report
    cfg = insp.config or {}
    dtypes: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for _, info in insp.tensors.values():
        dtypes[info.dtype][0] += 1
        dtypes[info.dtype][1] += info.nbytes
    shards = []
    for rel in sorted(r for r in insp.files if r.endswith(".safetensors")):
        h = insp.headers.get(rel)
        shards.append(
            {
                "file": rel,
                "size": insp.files[rel],
                "tensors": len(h.tensors) if h else None,
                "dtypes": sorted({t.dtype for t in h.tensors.values()}) if h else None,
                "valid": h is not None,
            }
        )
    summary = {
        "model_dir": model_dir,
        "architectures": cfg.get("architectures"),
        "model_type": cfg.get("model_type"),
        "files": len(insp.files),
        "bytes": sum(insp.files.values()),
        "tensors": len(insp.tensors),
        "dtypes": {k: {"tensors": v[0], "bytes": v[1]} for k, v in sorted(dtypes.items())},
        "modelslim": summarize(insp.description) if insp.description is not None else None,
        "shards": shards,
    }
    return summary, report


def format_summary(s: dict, report: Report) -> str:
    lines = [f"model directory : {s['model_dir']}"]
    if "files" not in s:
        return "\n".join(lines + [report.format()])
    archs = ", ".join(s["architectures"] or []) or "?"
    lines.append(f"architecture    : {archs} (model_type {s['model_type']!r})")
    lines.append(f"size            : {_mib(s['bytes'])} in {s['files']} files, {s['tensors']} tensors")
    dt = ", ".join(f"{k} {v['tensors']} ({_mib(v['bytes'])})" for k, v in s["dtypes"].items())
    lines.append(f"dtypes          : {dt or '-'}")
    ms = s["modelslim"]
    if ms:
        counts = ", ".join(f"{k} {v}" for k, v in ms["type_counts"].items())
        lines.append(f"quantization    : ModelSlim {ms['version']} {ms['model_quant_type']}; tensor types: {counts}")
    else:
        lines.append("quantization    : none (no quant_model_description.json)")
    width = max([len(sh["file"]) for sh in s["shards"]] + [5])
    lines.append("")
    lines.append(f"{'shard':<{width}}  {'size':>12}  {'tensors':>7}  dtypes")
    for sh in s["shards"]:
        n = sh["tensors"] if sh["valid"] else "INVALID"
        lines.append(f"{sh['file']:<{width}}  {_mib(sh['size']):>12}  {n!s:>7}  {','.join(sh['dtypes'] or [])}")
    if report.problems:
        lines.append("")
        lines.append(f"{len(report.errors)} problem(s):" if report.errors else "notes:")
        lines += [f"  {p}" for p in report.errors + report.notes]
    return "\n".join(lines)


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
        f"engine: {eng['distribution'] or 'vllm'} {eng['version'] or '(not installed)'}, {verdict} the tested range "
        f"{eng['tested_range']}; {eng['override_env']}: {override_text}"
        + (" (start-up is refused)" if eng["in_range"] is False and override is not True else "")
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
