"""Tiny-checkpoint factory.

``make_checkpoint(out_dir, config, weights)`` writes ``config.json``, seeded
random safetensors in the real checkpoint naming, and a local tokenizer.
Model-specific factories (tiny Llama here, each adapter's in its tests) build
on it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

from ascend_adapters.common.tokenizer import write_tokenizer

TINY_VOCAB = 512


def write_safetensors_shards(
    out_dir: Path, tensors: Mapping, max_shard_bytes: int | None = None, stem: str = "model"
) -> list[str]:
    """Save tensors as one file or as HF-style shards plus an index."""
    from safetensors.torch import save_file

    items = list(tensors.items())
    shards: list[dict] = [{}]
    size = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        fname = f"{stem}.safetensors"
        save_file(shards[0], str(out_dir / fname), metadata={"format": "pt"})
        return [fname]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        names.append(fname)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for _, t in items)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return names


def make_checkpoint(
    out_dir: str | Path,
    config: dict,
    weights: Mapping | Callable[[dict], Mapping],
    *,
    max_shard_bytes: int | None = None,
    tokenizer: bool = True,
) -> Path:
    """Write a checkpoint directory; ``weights`` may be a function of the config."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        write_tokenizer(out, vocab_size=config.get("vocab_size", TINY_VOCAB))
    tensors = weights(config) if callable(weights) else weights
    write_safetensors_shards(out, tensors, max_shard_bytes=max_shard_bytes)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def tiny_llama_config(**overrides) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": TINY_VOCAB,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }
    cfg.update(overrides)
    return cfg


def tiny_llama_weights(cfg: dict, seed: int = 0, std: float = 0.05) -> dict:
    """Random float32 weights in the HF Llama naming."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * std

    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    nq, nkv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    w = {"model.embed_tokens.weight": rnd(v, h) * 20, "model.norm.weight": 1 + rnd(h), "lm_head.weight": rnd(v, h) * 4}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w |= {
            p + "input_layernorm.weight": 1 + rnd(h),
            p + "post_attention_layernorm.weight": 1 + rnd(h),
            p + "self_attn.q_proj.weight": rnd(nq, h),
            p + "self_attn.k_proj.weight": rnd(nkv, h),
            p + "self_attn.v_proj.weight": rnd(nkv, h),
            p + "self_attn.o_proj.weight": rnd(h, nq),
            p + "mlp.gate_proj.weight": rnd(i, h),
            p + "mlp.up_proj.weight": rnd(i, h),
            p + "mlp.down_proj.weight": rnd(h, i),
        }
    return w


def make_tiny_llama(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    cfg = tiny_llama_config(**overrides)
    return make_checkpoint(out_dir, cfg, lambda c: tiny_llama_weights(c, seed=seed))
