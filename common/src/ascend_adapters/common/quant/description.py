"""ModelSlim (msModelSlim) export description: parsing and start-up checks.

No torch, no vLLM: this module reads ``quant_model_description.json`` and the
safetensors *headers* of an export so that bad input fails at start-up with a
message naming the file, tensor or field.

The description is a flat JSON map ``tensor name -> type string`` plus a few
top-level metadata keys (``version``, ``model_quant_type``, ``group_size``,
``metadata``, ``optional``, ``kv_cache_type``, ...). A layer is looked up by
``prefix + ".weight"``; a layer missing from the description is ``FLOAT``
(real exports omit e.g. MTP layers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ascend_adapters.common.admission.safetensors_header import HeaderError, read_tensors

DESCRIPTION_FILE = "quant_model_description.json"

W8A8 = "W8A8"
W8A8_DYNAMIC = "W8A8_DYNAMIC"
FLOAT = "FLOAT"

#: Type strings this project executes.
SUPPORTED_TYPES = (W8A8, W8A8_DYNAMIC, FLOAT)
#: Type strings ModelSlim writes that this project does not execute (clear error instead of "unknown").
KNOWN_UNSUPPORTED_TYPES = (
    "W4A8_DYNAMIC", "W4A16", "W8A16", "W4A4_DYNAMIC", "W8A8_MIX", "W8A8_MXFP8", "W4A4_MXFP4",
    "W4A8_MXFP", "W8A8MXFP8", "W4A4MXFP4", "C8", "FAKQuant", "FAQuant", "W4A8", "W16A16S", "W8A8S",
    "W8A8_FLATQUANT_DYNAMIC", "W4A4_FLATQUANT_DYNAMIC", "W8A8_DYNAMIC_MIX",
)  # fmt: skip

#: Top-level keys that are metadata, not tensor names.
METADATA_KEYS = frozenset({
    "version", "model_quant_type", "group_size", "metadata", "optional", "kv_cache_type",
    "fa_quant_type", "indexer_quant_type", "reduce_quant_type", "kv_quant_type", "quantize",
})  # fmt: skip
#: Metadata keys whose presence (with a value other than FLOAT/empty) asks for a feature we lack.
UNSUPPORTED_FEATURE_KEYS = ("kv_cache_type", "fa_quant_type", "indexer_quant_type", "reduce_quant_type")

# Companion tensors each linear type needs next to ``<prefix>.weight`` (name -> allowed safetensors dtypes).
COMPANIONS: dict[str, dict[str, tuple[str, ...]]] = {
    W8A8_DYNAMIC: {"weight_scale": ("F32", "F16", "BF16")},
    W8A8: {
        "input_scale": ("F32", "F16", "BF16"),
        "input_offset": ("F32", "F16", "BF16", "I8", "I32", "I64"),
        "deq_scale": ("F32", "I64"),
        "quant_bias": ("I32",),
    },
}
OPTIONAL_COMPANIONS: dict[str, dict[str, tuple[str, ...]]] = {
    W8A8_DYNAMIC: {"weight_offset": ("F32", "F16", "BF16")},
    W8A8: {"bias": ("F32", "F16", "BF16")},
}
QUANT_WEIGHT_DTYPE = "I8"

#: Weight file names seen in the wild, newest first.
WEIGHT_FILE_PATTERNS = (
    "quant_model_weights-*.safetensors",
    "quant_model_weight_w8a8*.safetensors",
    "quant_model_weights*.safetensors",
    "*.safetensors",
)


class DescriptionError(ValueError):
    """A ModelSlim description or export that cannot be served (message names the culprit)."""


@dataclass
class Description:
    """Parsed ``quant_model_description.json``."""

    types: dict[str, str]
    metadata: dict = field(default_factory=dict)
    source: str = "<dict>"

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict, source: str = "<dict>") -> Description:
        if not isinstance(raw, dict):
            raise DescriptionError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        types, meta = {}, {}
        for key, value in raw.items():
            if key in METADATA_KEYS or "." not in key:
                meta[key] = value
                continue
            if not isinstance(value, str):
                raise DescriptionError(f"{source}: tensor {key!r} has a non-string type {value!r}")
            value = value.strip()
            if value not in SUPPORTED_TYPES:
                if value in KNOWN_UNSUPPORTED_TYPES:
                    raise DescriptionError(
                        f"{source}: tensor {key!r} has quantization type {value!r}, which ascend-adapters "
                        f"does not support (supported: {', '.join(SUPPORTED_TYPES)})"
                    )
                raise DescriptionError(
                    f"{source}: tensor {key!r} has unknown quantization type {value!r} "
                    f"(supported: {', '.join(SUPPORTED_TYPES)})"
                )
            types[key] = value
        for feat in UNSUPPORTED_FEATURE_KEYS:
            v = meta.get(feat)
            if v not in (None, "", FLOAT, "FLOAT16", "BF16", "NONE", "None"):
                raise DescriptionError(
                    f"{source}: {feat}={v!r} asks for a quantized cache/attention path that "
                    "ascend-adapters does not implement"
                )
        return cls(types=types, metadata=meta, source=source)

    @classmethod
    def from_file(cls, path: str | Path) -> Description:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise DescriptionError(f"{path}: not found") from None
        except json.JSONDecodeError as exc:
            raise DescriptionError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Description:
        return cls.from_file(Path(model_dir) / DESCRIPTION_FILE)

    def to_dict(self) -> dict:
        return {**self.metadata, **self.types}

    # -- lookups ------------------------------------------------------------------------------
    @property
    def model_quant_type(self) -> str | None:
        return self.metadata.get("model_quant_type")

    def layer_type(self, prefix: str) -> str:
        """The type of linear ``prefix`` (``prefix.weight``); FLOAT when the description omits it."""
        return self.types.get(prefix + ".weight", FLOAT)

    def fused_type(self, prefix: str, shard_prefixes: list[str]) -> str:
        """The common type of the checkpoint shards fused into one module; an error names a mismatch."""
        kinds = {p: self.layer_type(p) for p in shard_prefixes}
        if len(set(kinds.values())) > 1:
            listing = ", ".join(f"{p}.weight={t}" for p, t in kinds.items())
            raise DescriptionError(
                f"{self.source}: the shards fused into {prefix!r} have different quantization "
                f"types ({listing}); one fused vLLM module needs one type"
            )
        return next(iter(kinds.values()))

    def rename(self, fn) -> None:
        """Rename tensor keys with ``fn(name) -> new name | None`` (None keeps the name)."""
        self.types = {(fn(k) or k): v for k, v in self.types.items()}

    def quantized_weights(self) -> dict[str, str]:
        """``prefix -> type`` for every quantized linear (``*.weight`` entries that are not FLOAT)."""
        return {k[: -len(".weight")]: v for k, v in self.types.items() if k.endswith(".weight") and v != FLOAT}


# -- safetensors headers (no torch; admission's reader, with its size cap) -----------------------
def read_safetensors_header(path: str | Path) -> dict[str, dict]:
    """``name -> {"dtype", "shape", "file"}`` from a safetensors file's validated header."""
    path = Path(path)
    try:
        tensors = read_tensors(path)
    except HeaderError as exc:
        raise DescriptionError(str(exc)) from None
    return {k: {"dtype": t.dtype, "shape": list(t.shape), "file": path.name} for k, t in tensors.items()}


def weight_files(model_dir: str | Path) -> list[Path]:
    """The export's weight files, through its index when there is one."""
    model_dir = Path(model_dir)
    for index in sorted(model_dir.glob("*.safetensors.index.json")):
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (KeyError, json.JSONDecodeError) as exc:
            raise DescriptionError(f"{index}: not a valid safetensors index ({exc})") from None
        files = sorted({model_dir / f for f in wm.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise DescriptionError(f"{index}: lists missing weight files {missing}")
        return files
    for pattern in WEIGHT_FILE_PATTERNS:
        files = sorted(model_dir.glob(pattern))
        if files:
            return files
    raise DescriptionError(f"{model_dir}: no *.safetensors weight files")


def checkpoint_tensors(model_dir: str | Path) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for f in weight_files(model_dir):
        out.update(read_safetensors_header(f))
    return out


def check_export(model_dir: str | Path, description: Description | None = None) -> list[str]:
    """Check description against weight files (headers only). Raises on the first problem list.

    Checks: every quantized ``*.weight`` exists and is int8; every required companion exists with an
    allowed dtype; every description entry names a tensor that exists. Returns notes (not errors).
    """
    model_dir = Path(model_dir)
    description = description or Description.from_model_dir(model_dir)
    tensors = checkpoint_tensors(model_dir)
    problems, notes = [], []
    for prefix, kind in sorted(description.quantized_weights().items()):
        w = tensors.get(prefix + ".weight")
        if w is None:
            problems.append(f"{prefix}.weight: listed as {kind} but not in the weight files")
            continue
        if w["dtype"] != QUANT_WEIGHT_DTYPE:
            problems.append(f"{prefix}.weight: {kind} needs int8, the file has {w['dtype']} ({w['file']})")
        for comp, dtypes in COMPANIONS.get(kind, {}).items():
            t = tensors.get(f"{prefix}.{comp}")
            if t is None:
                problems.append(f"{prefix}.{comp}: missing companion of {kind} weight {prefix}.weight")
            elif t["dtype"] not in dtypes:
                problems.append(f"{prefix}.{comp}: dtype {t['dtype']} not allowed for {kind} (allowed {dtypes})")
        for comp, dtypes in OPTIONAL_COMPANIONS.get(kind, {}).items():
            t = tensors.get(f"{prefix}.{comp}")
            if t is not None and t["dtype"] not in dtypes:
                problems.append(f"{prefix}.{comp}: dtype {t['dtype']} not allowed for {kind} (allowed {dtypes})")
    for name, kind in description.types.items():
        if name not in tensors:
            if kind == FLOAT and _is_tied_lm_head(name, tensors):
                continue
            problems.append(f"{name}: listed in {DESCRIPTION_FILE} ({kind}) but not in the weight files")
    for name, info in tensors.items():
        if info["dtype"] == QUANT_WEIGHT_DTYPE and name.endswith(".weight") and name not in description.types:
            problems.append(f"{name}: int8 tensor not listed in {DESCRIPTION_FILE} (its type is unknown)")
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise DescriptionError(f"{model_dir}: ModelSlim export does not match its description:\n  {shown}{more}")
    return notes


def _is_tied_lm_head(name: str, tensors: dict) -> bool:
    return name == "lm_head.weight" and "model.embed_tokens.weight" in tensors


def expert_prefixes(experts_prefix: str, num_experts: int, projections: tuple[str, ...]) -> list[str]:
    """``<experts_prefix>.<e>.<proj>`` for every expert and projection."""
    return [f"{experts_prefix}.{e}.{p}" for e in range(num_experts) for p in projections]
