"""Tiny GLM-5.x DSA checkpoints saved by transformers itself (tests, demo, bench).

Head sizes are CPU-friendly (qk head 64 = 48 nope + 16 rope, v head 64) and the
indexer has 16 heads so the top-k boundary has no ties (docs/references.md#dsa-indexer-ties).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

TINY_CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    kv_lora_rank=32,
    q_lora_rank=64,
    qk_rope_head_dim=16,
    v_head_dim=64,
    qk_nope_head_dim=48,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    routed_scaling_factor=2.5,
    max_position_embeddings=1024,
    index_topk=8,
    index_head_dim=32,
    index_n_heads=16,
    first_k_dense_replace=1,
    indexer_types=["full", "full", "shared"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    num_nextn_predict_layers=1,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def make_tiny(
    out_dir: str | Path, seed: int = 0, std: float = 0.08, tokenizer: bool = True, mtp: bool = True, **overrides
) -> Path:
    """Write a random tiny ``GlmMoeDsaForCausalLM`` with ``save_pretrained`` (float32).

    ``std`` sets the init scale (larger than the default 0.02 so logits are not
    flat); ``overrides`` change config fields (e.g. ``index_topk=64``). ``mtp``: add the
    MTP layer as released checkpoints carry it (``add_mtp_layer``; transformers does not build it).
    """
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(TINY_CONFIG, initializer_range=std)
    cfg.update(overrides)
    config = GlmMoeDsaConfig(**cfg)
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(config).float().eval()
    _spread_vectors(model, torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(10)
    model.save_pretrained(str(out))
    if mtp and config.num_nextn_predict_layers:
        add_mtp_layer(out, seed=seed + 2, std=std)
    if tokenizer:
        from ascend_adapters.common.tokenizer import write_tokenizer

        write_tokenizer(out, vocab_size=config.vocab_size)
    # record the tiny-model provenance next to the weights
    (out / "tiny_glm_dsa.json").write_text(
        json.dumps({"seed": seed, "std": std, "overrides": overrides}, default=str, indent=2)
    )
    return out


def _spread_vectors(model, g) -> None:
    """Router biases around 0 and norms around 1 (not exactly 1), so every vector matters."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias") or (p.dim() == 1 and "bias" in name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif p.dim() == 1:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.1)


def mtp_layer_config(config: dict) -> dict:
    """The config of a one-layer model whose layer 0 is the MTP layer of ``config`` (a 'full' DSA layer
    with the MoE of a layer after ``first_k_dense_replace``): how transformers builds the layer."""
    n = config["num_hidden_layers"]
    return dict(
        config,
        num_hidden_layers=1,
        indexer_types=["full"],
        layer_types=(config.get("layer_types") or ["indexed_attention"])[-1:],
        mlp_layer_types=["sparse" if n >= config.get("first_k_dense_replace", 0) else "dense"],
        first_k_dense_replace=0,
        num_nextn_predict_layers=0,
    )


def add_mtp_layer(ckpt: str | Path, seed: int = 2, std: float = 0.08) -> list[str]:
    """Add the checkpoint's MTP layer in the released layout, ``model.layers.<num_hidden_layers>.*``: a full
    decoder layer (made by transformers, see ``mtp_layer_config``) plus ``enorm``, ``hnorm``, ``eh_proj`` and
    ``shared_head.norm``. Returns the names added."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    ckpt = Path(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    torch.manual_seed(seed)
    layer_cfg = GlmMoeDsaConfig(**{k: v for k, v in mtp_layer_config(cfg).items() if k != "architectures"})
    donor = GlmMoeDsaForCausalLM(layer_cfg).float()
    g = torch.Generator().manual_seed(seed + 1)
    _spread_vectors(donor, g)
    with tempfile.TemporaryDirectory() as tmp:
        donor.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    prefix = f"model.layers.{n}."
    added = {prefix + k[len("model.layers.0.") :]: v for k, v in saved.items() if k.startswith("model.layers.0.")}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        added[f"{prefix}{name}.weight"] = 1.0 + torch.randn(h, generator=g) * 0.1
    added[prefix + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * std
    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    tensors.update(added)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return sorted(added)
