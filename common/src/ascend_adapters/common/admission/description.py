"""Checks of a ModelSlim ``quant_model_description.json`` against the tensors on disk.

The description maps every tensor name (weights and their companions) to a
type string, beside a few non-tensor top-level keys. Checked here:

- a known ``version`` and a supported ``model_quant_type``;
- only known type strings;
- every tensor on disk is described (names absent from the description are
  admitted as FLOAT only when the caller lists them, e.g. MTP layers), and
  every described tensor exists;
- every quantized weight is int8 ``[N, K]`` and has its companions with the
  right dtype and shape (static W8A8: input_scale, input_offset, deq_scale,
  quant_bias; W8A8_DYNAMIC: weight_scale, weight_offset), described with the
  weight's type; no companion without its quantized weight;
- all shards fused into one vLLM module (q/k/v, gate/up, ...) share a type.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable, Mapping

from ascend_adapters.common.admission.report import Report
from ascend_adapters.common.admission.safetensors_header import FLOAT_DTYPES, TensorInfo

DESCRIPTION_FILE = "quant_model_description.json"
KNOWN_VERSIONS = frozenset({"1.0.0"})
# W8A8_MIX: per-layer mix of the supported types (each tensor's own type is what is checked).
SUPPORTED_MODEL_QUANT_TYPES = frozenset({"W8A8", "W8A8_DYNAMIC", "W8A8_MIX"})
KNOWN_TYPES = frozenset({"FLOAT", "W8A8", "W8A8_DYNAMIC"})
# Top-level keys that are not tensor names.
META_KEYS = frozenset(
    {
        "version",
        "model_quant_type",
        "group_size",
        "metadata",
        "optional",
        "kv_cache_type",
        "fa_quant_type",
        "indexer_quant_type",
        "reduce_quant_type",
        "kv_quant_type",
        "quantize",
    }
)
# Metadata keys that ask for a quantized cache/attention path this project does not implement
# unless their value says "float".
FEATURE_KEYS = ("kv_cache_type", "fa_quant_type", "indexer_quant_type", "reduce_quant_type")
_FEATURE_OFF = (None, "", "FLOAT", "FLOAT16", "BF16", "NONE", "None")

FLOATS = FLOAT_DTYPES - {"F64"}
# Storage of quantized weights: a tensor described (or admitted) as FLOAT must not use it. Other
# integer dtypes stay allowed for FLOAT entries (routing buffers such as expert maps are integers).
QUANTIZED_DTYPES = frozenset({"I8", "U8"})
# suffix -> (allowed dtypes, shape as a function of (N, K)); required ones per type.
_COMPANIONS = {
    "W8A8": {
        "input_scale": (FLOATS, lambda n, k: (1,)),
        "input_offset": (FLOATS | {"I8", "I32", "I64"}, lambda n, k: (1,)),
        "deq_scale": (frozenset({"I64", "F32"}), lambda n, k: (n,)),
        "quant_bias": (frozenset({"I32"}), lambda n, k: (n,)),
    },
    "W8A8_DYNAMIC": {
        "weight_scale": (FLOATS, lambda n, k: (n, 1)),
        "weight_offset": (FLOATS, lambda n, k: (n, 1)),
    },
}
# Companions a type may carry without requiring them.
_OPTIONAL = {
    "W8A8": {"bias": (FLOATS, lambda n, k: (n,))},
    "W8A8_DYNAMIC": {"bias": (FLOATS, lambda n, k: (n,))},
}
COMPANION_SUFFIXES = frozenset(s for table in _COMPANIONS.values() for s in table)

# Checkpoint projections that vLLM fuses into one module: they must share a type.
FUSED_GROUPS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("w1", "w3"),
)


def load_description(path, where: str, report: Report) -> dict | None:
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        report.error("ms-description-json", where, f"cannot parse ModelSlim description ({exc})")
        return None
    if not isinstance(obj, dict):
        report.error("ms-description-json", where, "ModelSlim description is not a JSON object")
        return None
    return obj


def summarize(desc: Mapping) -> dict:
    """The manifest's ``modelslim`` summary fields derived from a description."""
    counts = collections.Counter(v for k, v in desc.items() if k not in META_KEYS and isinstance(v, str))
    return {
        "version": desc.get("version"),
        "model_quant_type": desc.get("model_quant_type"),
        "type_counts": dict(sorted(counts.items())),
    }


def check_description(
    desc: Mapping,
    tensors: Mapping[str, TensorInfo],
    report: Report,
    *,
    where: str = DESCRIPTION_FILE,
    undescribed_as_float: Iterable[str] = (),
    tensors_complete: bool = True,
) -> list[str]:
    """Check ``desc`` against ``tensors`` (name -> header info); returns the undescribed tensor names.

    With ``tensors_complete=False`` (some shard header could not be read) only the description's
    own fields are checked: tensor-level findings would only echo the unreadable shard.
    """
    allowed_absent = set(undescribed_as_float)
    version = desc.get("version")
    if version not in KNOWN_VERSIONS:
        report.error("ms-version", f"{where}:version", f"unknown description version {version!r}")
    mqt = desc.get("model_quant_type")
    if mqt not in SUPPORTED_MODEL_QUANT_TYPES:
        report.error(
            "ms-model-quant-type",
            f"{where}:model_quant_type",
            f"unsupported model_quant_type {mqt!r} (supported: {sorted(SUPPORTED_MODEL_QUANT_TYPES)})",
        )
    for key in FEATURE_KEYS:
        if desc.get(key) not in _FEATURE_OFF:
            report.error(
                "ms-feature",
                f"{where}:{key}",
                f"{key}={desc.get(key)!r} asks for a quantized cache/attention path ascend-adapters does not implement",
            )
    types: dict[str, str] = {}
    for key, value in desc.items():
        if key in META_KEYS:
            continue
        if not isinstance(value, str):
            report.error("ms-description-key", f"{where}:{key}", f"unknown non-tensor key (value {value!r})")
            continue
        if value not in KNOWN_TYPES:
            report.error("ms-type", f"{where}:{key}", f"unknown quant type {value!r} (known: {sorted(KNOWN_TYPES)})")
            continue
        types[key] = value
        if tensors_complete and key not in tensors:
            report.error("ms-missing-tensor", key, f"described as {value} in {where} but not in any shard")

    if not tensors_complete:
        return []
    undescribed = sorted(n for n in tensors if n not in desc)
    for name in undescribed:
        if name in allowed_absent:
            report.note("ms-undescribed", name, f"absent from {where}; admitted as FLOAT as the manifest declares")
            if tensors[name].dtype in QUANTIZED_DTYPES:
                report.error("ms-dtype", name, f"undescribed tensor treated as FLOAT has dtype {tensors[name].dtype}")
        else:
            report.error(
                "ms-undescribed",
                name,
                f"tensor is absent from {where}; if it is kept in float (e.g. MTP layers) "
                "declare it with `manifest --undescribed-as-float`",
            )
    for name in sorted(allowed_absent - set(undescribed)):
        report.error("ms-undescribed", name, f"declared undescribed-as-float, but {where} or the shards disagree")

    quantized = {}
    for name, qtype in types.items():
        if name not in tensors:
            continue
        if qtype == "FLOAT":
            if tensors[name].dtype in QUANTIZED_DTYPES:
                report.error("ms-dtype", name, f"described as FLOAT but stored as {tensors[name].dtype}")
            continue
        if not name.endswith(".weight"):
            continue
        w = tensors[name]
        prefix = name[: -len(".weight")]
        if w.dtype != "I8" or len(w.shape) != 2:
            report.error("ms-weight", name, f"{qtype} weight must be I8 [N, K], is {w.dtype} {list(w.shape)}")
            continue
        quantized[prefix] = qtype
        n, k = w.shape
        required = _COMPANIONS[qtype]
        for suffix, (dtypes, shape_fn) in list(required.items()) + list(_OPTIONAL[qtype].items()):
            cname = f"{prefix}.{suffix}"
            c = tensors.get(cname)
            if c is None:
                if suffix in required:
                    report.error("ms-companion-missing", cname, f"required by {qtype} weight {name}, not in any shard")
                continue
            want = shape_fn(n, k)
            if c.dtype not in dtypes:
                report.error("ms-companion-dtype", cname, f"dtype {c.dtype}, expected one of {sorted(dtypes)}")
            if tuple(c.shape) != want:
                report.error("ms-companion-shape", cname, f"shape {list(c.shape)}, expected {list(want)} for {name}")
            ctype = desc.get(cname)
            if suffix in required and isinstance(ctype, str) and ctype != qtype:
                report.error("ms-companion-type", cname, f"described as {ctype}, its weight {name} as {qtype}")

    for name in tensors:
        prefix, _, suffix = name.rpartition(".")
        if suffix in COMPANION_SUFFIXES and prefix not in quantized:
            wtype = types.get(prefix + ".weight", "absent")
            if prefix + ".weight" in tensors and wtype == "FLOAT":
                report.error("ms-orphan-companion", name, f"quant companion of a FLOAT weight {prefix}.weight")
            elif prefix + ".weight" not in tensors:
                report.error("ms-orphan-companion", name, f"quant companion without its weight {prefix}.weight")

    for group in FUSED_GROUPS:
        seen: dict[str, dict[str, str]] = collections.defaultdict(dict)
        for name, qtype in types.items():
            if not name.endswith(".weight"):
                continue
            head, _, proj = name[: -len(".weight")].rpartition(".")
            if proj in group:
                seen[head][proj] = qtype
        for head, members in seen.items():
            if len(set(members.values())) > 1:
                detail = ", ".join(f"{p}={t}" for p, t in sorted(members.items()))
                report.error("ms-fused-type", f"{head}.{{{','.join(group)}}}", f"fused shards differ in type: {detail}")
    return undescribed
