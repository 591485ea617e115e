"""Convert a BlinkDL RWKV-7 ``.pth`` checkpoint into an HF-layout directory.

    python -m ascend_adapters.rwkv7.convert SRC.pth OUT_DIR [--dtype float32|bfloat16|float16]
    rwkv7-convert SRC.pth OUT_DIR

Writes ``config.json`` (dims inferred from the tensor shapes, fla field names,
``norm_eps = 64e-5 / head_dim``), ``model.safetensors`` (or shards plus an
index) and the World tokenizer files. Every source tensor is either mapped or
skipped on purpose (listed in the report); a missing, misshaped or unknown
tensor is an error naming it. The source file is only read.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from ascend_adapters.rwkv7.config import (
    RWKV_GROUP_NORM_EPS,
    RWKV_LAYER_NORM_EPS,
    SUPPORTED_HEAD_DIMS,
    Rwkv7Config,
    Rwkv7ConfigError,
    check_shapes,
    hf_tensor_shapes,
    validate_config,
)
from ascend_adapters.rwkv7.remap import blinkdl_remapper

ARCHITECTURE = "RWKV7ForCausalLM"
DTYPES = ("float32", "bfloat16", "float16")
MAX_SHARD_BYTES = 4 << 30


class ConversionError(Rwkv7ConfigError):
    pass


def blinkdl_tensor_shapes(n_layer, c, h, n, vocab, inter, ranks) -> dict[str, tuple[int, ...]]:
    """Every tensor of a BlinkDL x070 checkpoint (layer 0's unused v0/v1/v2 are optional, not listed)."""
    shapes = {
        "emb.weight": (vocab, c),
        "ln_out.weight": (c,),
        "ln_out.bias": (c,),
        "head.weight": (vocab, c),
        "blocks.0.ln0.weight": (c,),
        "blocks.0.ln0.bias": (c,),
    }
    for i in range(n_layer):
        p = f"blocks.{i}."
        for ln in ("ln1", "ln2"):
            shapes[p + ln + ".weight"] = (c,)
            shapes[p + ln + ".bias"] = (c,)
        for x in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "k_k", "k_a"):
            shapes[p + "att." + x] = (1, 1, c)
        shapes[p + "att.r_k"] = (h, n)
        for lora in "wavg":
            if lora == "v" and i == 0:
                continue
            if lora != "g":
                shapes[p + f"att.{lora}0"] = (1, 1, c)
            shapes[p + f"att.{lora}1"] = (c, ranks[lora])
            shapes[p + f"att.{lora}2"] = (ranks[lora], c)
        for proj in ("receptance", "key", "value", "output"):
            shapes[p + f"att.{proj}.weight"] = (c, c)
        shapes[p + "att.ln_x.weight"] = (c,)
        shapes[p + "att.ln_x.bias"] = (c,)
        shapes[p + "ffn.x_k"] = (1, 1, c)
        shapes[p + "ffn.key.weight"] = (inter, c)
        shapes[p + "ffn.value.weight"] = (c, inter)
    return shapes


def _shape(sd, name, src):
    if name not in sd:
        raise ConversionError(f"{src}: missing tensor {name!r} (needed to infer the model dimensions)")
    return tuple(sd[name].shape)


def infer_config(sd: dict, src: str = "checkpoint", dtype: str = "float32") -> Rwkv7Config:
    """Dimensions from tensor shapes, checked for consistency; raises naming the tensor."""
    vocab, c = _shape(sd, "emb.weight", src)
    r_k = _shape(sd, "blocks.0.att.r_k", src)
    if len(r_k) != 2:
        raise ConversionError(f"{src}: tensor 'blocks.0.att.r_k' has shape {list(r_k)}, expected [n_head, head_size]")
    h, n = r_k
    if n not in SUPPORTED_HEAD_DIMS:
        raise ConversionError(
            f"{src}: head size {n} (from 'blocks.0.att.r_k' shape {list(r_k)}) is not supported; "
            f"supported head sizes: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
        )
    if h * n != c:
        raise ConversionError(
            f"{src}: 'blocks.0.att.r_k' shape {list(r_k)} gives {h}x{n}={h * n} channels but 'emb.weight' has {c}"
        )
    layers = set()
    for name in sd:
        m = re.match(r"^blocks\.(\d+)\.", name)
        if m:
            layers.add(int(m.group(1)))
    n_layer = max(layers) + 1
    missing_layers = sorted(set(range(n_layer)) - layers)
    if missing_layers:
        raise ConversionError(
            f"{src}: no tensors for layer(s) {missing_layers} (blocks.N.*) but layer {n_layer - 1} exists"
        )
    inter = _shape(sd, "blocks.0.ffn.key.weight", src)[0]
    ranks = {x: _shape(sd, f"blocks.0.att.{x}1", src)[-1] for x in "wag"}
    if n_layer > 1:
        ranks["v"] = _shape(sd, "blocks.1.att.v1", src)[-1]
    else:  # unused with one layer; keep the checkpoint's value when it has one
        ranks["v"] = sd["blocks.0.att.v1"].shape[-1] if "blocks.0.att.v1" in sd else 32
    cfg = Rwkv7Config(
        architectures=[ARCHITECTURE],
        hidden_size=c,
        num_hidden_layers=n_layer,
        head_dim=n,
        num_heads=h,
        hidden_ratio=inter / c,
        intermediate_size=inter,
        decay_low_rank_dim=ranks["w"],
        a_low_rank_dim=ranks["a"],
        v_low_rank_dim=ranks["v"],
        gate_low_rank_dim=ranks["g"],
        vocab_size=vocab,
        norm_eps=RWKV_GROUP_NORM_EPS / n,
        layer_norm_eps=RWKV_LAYER_NORM_EPS,
        value_dim=[c] * n_layer,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        max_position_embeddings=1 << 20,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    validate_config(cfg, source=src)
    expected = blinkdl_tensor_shapes(n_layer, c, h, n, vocab, inter, ranks)
    optional = {"blocks.0.att.v0", "blocks.0.att.v1", "blocks.0.att.v2"}
    problems = []
    for name, shape in expected.items():
        if name not in sd:
            problems.append(f"missing tensor {name!r} (expected shape {list(shape)})")
        elif tuple(sd[name].shape) != shape:
            problems.append(f"tensor {name!r} has shape {list(sd[name].shape)}, expected {list(shape)}")
    problems += [
        f"unknown tensor {k!r} (shape {list(sd[k].shape)})" for k in sorted(set(sd) - set(expected) - optional)
    ]
    if problems:
        raise ConversionError(
            f"{src}: not a consistent RWKV-7 (x070) checkpoint with {n_layer} layers, C={c}, head size {n}, "
            f"vocab {vocab}, ffn {inter}:\n  " + "\n  ".join(problems)
        )
    return cfg


def load_pth(path: Path) -> dict:
    import torch

    try:
        sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise ConversionError(f"{path}: cannot read as a torch checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ConversionError(f"{path}: expected a flat dict of tensors (a BlinkDL state dict)")
    return sd


def _save(out: Path, tensors: dict) -> list[str]:
    from safetensors.torch import save_file

    shards, size = [{}], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        names.append(fname)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return names


def convert(
    src: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    vocab: str | Path | None = None,
    tokenizer: bool = True,
    overwrite: bool = False,
    log=print,
) -> Path:
    import torch

    src, out = Path(src), Path(out_dir)
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if not src.is_file():
        raise ConversionError(f"{src}: no such file")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConversionError(f"{out}: directory exists and is not empty (pass --overwrite to write into it)")
    sd = load_pth(src)
    cfg = infer_config(sd, src=str(src), dtype=dtype)
    targets = hf_tensor_shapes(cfg)
    remapper = blinkdl_remapper(targets=set(targets))
    torch_dtype = getattr(torch, dtype)
    tensors = {name: t.to(torch_dtype).contiguous() for name, t in remapper.apply(sd.items())}
    report = remapper.finish(required=targets)
    if report.unused:
        raise ConversionError(f"{src}: no source tensor for {report.unused}")
    check_shapes(cfg, {k: tuple(v.shape) for k, v in tensors.items()}, source=f"{src} (after remap)")
    out.mkdir(parents=True, exist_ok=True)
    files = _save(out, tensors)
    cfg.save_pretrained(str(out))
    log(
        f"converted {src} -> {out}: {cfg.num_hidden_layers} layers, C={cfg.hidden_size}, "
        f"{cfg.num_heads} heads of {cfg.head_dim}, vocab {cfg.vocab_size}, {dtype}, files {files}"
    )
    log(report.summary())
    if tokenizer:
        n_tok = _write_tokenizer(out, vocab)
        if n_tok > cfg.vocab_size:
            log(
                f"warning: the World tokenizer has {n_tok} ids but the model's vocab_size is {cfg.vocab_size}; "
                "text prompts may produce out-of-range ids"
            )
    return out


def _write_tokenizer(out: Path, vocab):
    from ascend_adapters.rwkv7.tokenizer import write_world_tokenizer

    return write_world_tokenizer(out, vocab)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rwkv7-convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="BlinkDL RWKV-7 checkpoint (.pth)")
    ap.add_argument("out_dir", help="output directory (HF layout)")
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--vocab", default=None, help="World vocabulary file (default: the one in the 'rwkv' package)")
    ap.add_argument("--no-tokenizer", action="store_true", help="do not write tokenizer files")
    ap.add_argument("--overwrite", action="store_true", help="write into a non-empty OUT_DIR")
    args = ap.parse_args(argv)
    try:
        convert(
            args.src,
            args.out_dir,
            dtype=args.dtype,
            vocab=args.vocab,
            tokenizer=not args.no_tokenizer,
            overwrite=args.overwrite,
        )
    except (Rwkv7ConfigError, FileNotFoundError) as exc:
        print(f"rwkv7-convert: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
