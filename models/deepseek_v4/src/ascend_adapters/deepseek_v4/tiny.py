"""Tiny random DeepSeek-V4 checkpoints saved by transformers (for tests and the demo).

``make_tiny(out_dir)`` builds transformers' own ``DeepseekV4ForCausalLM`` from a
small ``DeepseekV4Config``, gives the parameters transformers initialises to
constants (sinks, position biases, mHC bases, routing bias, ``tid2eid``) seeded
random values so every code path matters, and saves it with
``save_pretrained`` (float32) plus a local tokenizer. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

# vLLM forces its own `deepseek_v4` tokenizer mode for this architecture, which
# expects DeepSeek's tokenizer; the tiny checkpoint ships a small local BPE.
SERVE_ARGS = ["--tokenizer-mode", "hf"]

# ModelSlim W8A8_DYNAMIC plan for the tiny checkpoint (native export names; fnmatch on the linear
# prefix; common.testing.modelslim.export_w8a8): attention
# projections, shared and routed experts. Router, compressor/indexer projections (kept in float by
# transformers' own DeepSeek-V4 loading as well), the grouped wo_a, embeddings and head stay FLOAT.
W8A8_PLAN = {
    "*.attn.wq_a": "W8A8_DYNAMIC",
    "*.attn.wkv": "W8A8_DYNAMIC",
    "*.attn.wq_b": "W8A8_DYNAMIC",
    "*.attn.wo_b": "W8A8_DYNAMIC",
    "*.ffn.shared_experts.*": "W8A8_DYNAMIC",
    "*.ffn.experts.*": "W8A8_DYNAMIC",
}

# Small enough for a 2-core CPU, big enough that every branch is exercised:
# layer 0 sliding-only, 1 CSA (rate 4, indexer top-4), 2 HCA (rate 16), 3 CSA;
# hash-routed MoE in the first layer; window 16 so 100+ token prompts are many
# windows long. 16 indexer heads avoid score ties (REFERENCE §8).
TINY_CONFIG: dict = {
    "vocab_size": 512,
    "hidden_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "q_lora_rank": 64,
    "partial_rotary_factor": 0.25,
    "num_experts_per_tok": 2,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "swiglu_limit": 1.0,
    "sliding_window": 16,
    "o_groups": 2,
    "o_lora_rank": 32,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 4,
    "num_nextn_predict_layers": 0,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "initializer_range": 0.1,
}


def tiny_config(**overrides):
    """transformers' ``DeepseekV4Config`` for the tiny model (overrides merged in)."""
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**{**TINY_CONFIG, **overrides})


def build_tiny_model(seed: int = 0, **overrides):
    """transformers ``DeepseekV4ForCausalLM`` with every parameter seeded random (float32, eval)."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    config = tiny_config(**overrides)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("position_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith(("attn_hc.base", "ffn_hc.base", "hc_head.hc_base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith(("attn_hc.scale", "ffn_hc.scale", "hc_head.hc_scale")):
                p.copy_(1.0 + torch.rand(p.shape, generator=g))
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
            elif name.endswith("tid2eid"):
                n_exp = config.n_routed_experts
                rows = [torch.randperm(n_exp, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]
                b.copy_(torch.stack(rows).to(b.dtype))
    return model


def make_tiny(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a tiny DeepSeek-V4 checkpoint saved by transformers (float32) plus a tokenizer."""
    from ascend_adapters.common.testing.tokenizer import write_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(seed, **overrides)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out, vocab_size=model.config.vocab_size)
    # generation_config.json from transformers may carry sampling defaults; keep greedy-neutral.
    gen = out / "generation_config.json"
    if gen.exists():
        data = json.loads(gen.read_text())
        data.pop("temperature", None)
        gen.write_text(json.dumps(data, indent=2))
    return out
