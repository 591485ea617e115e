"""Artifacts and mutations shared by the admission tests (this module holds no tests).

Valid artifacts:
- ``float_single``: the tiny float Llama of the common factory (one shard);
- ``float_sharded``: the same weights in several shards plus an index;
- ``modelslim_dynamic`` / ``modelslim_static``: a ModelSlim-format W8A8 export
  of that tiny Llama written here, following docs/references.md#modelslim-export-files (description with
  companions described, ``quant_model_weights-0000N-of-0000M.safetensors`` +
  index). Real msmodelslim exports are exercised in test_admission.py when
  msmodelslim is installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def make_float_single(out: Path) -> Path:
    from ascend_adapters.testing.factory import make_tiny_llama

    return make_tiny_llama(out, seed=0)


def make_float_sharded(out: Path) -> Path:
    from ascend_adapters.testing.factory import make_checkpoint, tiny_llama_config, tiny_llama_weights

    return make_checkpoint(out, tiny_llama_config(), lambda c: tiny_llama_weights(c, seed=1), max_shard_bytes=400_000)


def modelslim_tensors(kind: str, seed: int = 2) -> tuple[dict, dict]:
    """(tensors, description) of a W8A8 export of the tiny Llama; kind is 'dynamic' or 'static'."""
    import torch

    from ascend_adapters.testing.factory import tiny_llama_config, tiny_llama_weights

    cfg = tiny_llama_config()
    weights = tiny_llama_weights(cfg, seed=seed)
    qtype = "W8A8_DYNAMIC" if kind == "dynamic" else "W8A8"
    tensors, desc = {}, {}
    for name, w in weights.items():
        prefix = name[: -len(".weight")]
        if not any(prefix.endswith(lin) for lin in LINEARS):
            tensors[name] = w
            desc[name] = "FLOAT"
            continue
        scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127.0
        q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
        tensors[name] = q
        desc[name] = qtype
        n = w.shape[0]
        if kind == "dynamic":
            comp = {"weight_scale": scale.float(), "weight_offset": torch.zeros(n, 1)}
        else:
            input_scale = torch.tensor([0.02])
            deq = (input_scale * scale.squeeze(1)).float()
            comp = {
                "input_scale": input_scale,
                "input_offset": torch.tensor([3.0]),
                "deq_scale": deq.view(torch.int32).to(torch.int64),
                "quant_bias": torch.zeros(n, dtype=torch.int32),
            }
        for suffix, t in comp.items():
            tensors[f"{prefix}.{suffix}"] = t.contiguous()
            desc[f"{prefix}.{suffix}"] = qtype
    desc.update({"version": "1.0.0", "model_quant_type": qtype, "metadata": {}, "group_size": 0, "optional": {}})
    return tensors, desc


def make_modelslim(out: Path, kind: str) -> Path:
    from ascend_adapters.common.tokenizer import write_tokenizer
    from ascend_adapters.testing.factory import tiny_llama_config, write_safetensors_shards

    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_llama_config()
    tensors, desc = modelslim_tensors(kind)
    write_tokenizer(out, vocab_size=cfg["vocab_size"])
    write_safetensors_shards(out, tensors, max_shard_bytes=300_000, stem="quant_model_weights")
    (out / "quant_model_description.json").write_text(json.dumps(desc, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return out


BUILDERS = {
    "float_single": make_float_single,
    "float_sharded": make_float_sharded,
    "modelslim_dynamic": lambda out: make_modelslim(out, "dynamic"),
    "modelslim_static": lambda out: make_modelslim(out, "static"),
}


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 + mode of every entry under root (symlinks by target), to prove nothing changed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames + dirnames):
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = p.lstat()
            if p.is_symlink():
                out[rel] = f"link:{os.readlink(p)}"
            elif p.is_file():
                out[rel] = f"{oct(st.st_mode)}:{st.st_mtime_ns}:" + hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = f"{oct(st.st_mode)}"
    return out


def copy_artifact(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


# -- safetensors editing helpers (test side: they may use any library) --------


def header_of(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def shards_of(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.safetensors"))


def rewrite_without(root: Path, tensor: str) -> str:
    """Remove ``tensor`` from its shard (rewritten consistently) and from the index; returns the shard."""
    from safetensors.torch import load_file, save_file

    for rel in shards_of(root):
        path = root / rel
        _, header = header_of(path)
        if tensor in header:
            tensors = load_file(str(path))
            del tensors[tensor]
            os.unlink(path)
            save_file(tensors, str(path), metadata=header.get("__metadata__"))
            for index in root.glob("*.safetensors.index.json"):
                data = json.loads(index.read_text())
                if data["weight_map"].pop(tensor, None) is not None:
                    total = data.get("metadata", {}).get("total_size")
                    if total is not None:
                        data["metadata"]["total_size"] = _data_bytes(root, data["weight_map"])
                    os.unlink(index)
                    index.write_text(json.dumps(data, indent=2))
            return rel
    raise KeyError(tensor)


def _data_bytes(root: Path, weight_map: dict) -> int:
    total = 0
    for shard in sorted(set(weight_map.values())):
        n, header = header_of(root / shard)
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


def build_templates(root: Path, names=None) -> dict[str, tuple[Path, dict]]:
    """Build the named artifacts under root with their manifests: name -> (dir, manifest)."""
    from ascend_adapters.common.admission import build_manifest

    out = {}
    for name in names or BUILDERS:
        d = BUILDERS[name](root / name)
        manifest, report = build_manifest(d, progress=False)
        assert manifest is not None, report.format()
        out[name] = (d, manifest)
    return out


def manifested(model_dir: Path, manifest_path: Path):
    """``model_dir``'s manifest, built (it must pass) and written to ``manifest_path``: (manifest, path)."""
    from ascend_adapters.common.admission import build_manifest, dump_manifest

    manifest, report = build_manifest(model_dir, progress=False)
    assert manifest is not None, report.format()
    dump_manifest(manifest, manifest_path)
    return manifest, manifest_path
