"""Human summary of a model directory: ``render DIR``."""

from __future__ import annotations

import collections

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
