"""Tiny random DeepSeek-V4 checkpoints saved by transformers (for tests and the demo).

``make_tiny(out_dir)`` builds transformers' own ``DeepseekV4ForCausalLM`` from a
small ``DeepseekV4Config``, gives the parameters transformers initialises to
constants (sinks, position biases, mHC bases, routing bias, ``tid2eid``) seeded
random values so every code path matters, and saves it with
``save_pretrained`` (float32) plus a local tokenizer. Nothing is downloaded.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ascend_adapters.deepseek_v4.config import MTP_LAYER_TYPE, MTP_MLP_TYPE

# vLLM forces its own `deepseek_v4` tokenizer mode for this architecture, which
# expects DeepSeek's tokenizer; the tiny checkpoint ships a small local BPE.
SERVE_ARGS = ["--tokenizer-mode", "hf"]

# Small enough for a 2-core CPU, big enough that every branch is exercised:
# layer 0 sliding-only, 1 CSA (rate 4, indexer top-4), 2 HCA (rate 16), 3 CSA;
# hash-routed MoE in the first layer; window 16 so 100+ token prompts are many
# windows long. 16 indexer heads avoid score ties (docs/references.md#dsa-indexer-ties).
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


def make_tiny(out_dir: str | Path, seed: int = 0, mtp: bool = False, **overrides) -> Path:
    """Write a tiny DeepSeek-V4 checkpoint saved by transformers (float32) plus a tokenizer; with ``mtp``,
    plus one MTP layer in DeepSeek's release layout (``add_mtp_layer``)."""
    from ascend_adapters.common.tokenizer import write_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(seed, **overrides)
    model.save_pretrained(out, safe_serialization=True)
    if mtp:
        add_mtp_layer(out, seed, **overrides)
    write_tokenizer(out, vocab_size=model.config.vocab_size)
    # generation_config.json from transformers may carry sampling defaults; keep greedy-neutral.
    gen = out / "generation_config.json"
    if gen.exists():
        data = json.loads(gen.read_text())
        data.pop("temperature", None)
        gen.write_text(json.dumps(data, indent=2))
    return out


def add_mtp_layer(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Append DeepSeek-V4's MTP layer (``mtp.0.*``, DeepSeek's native names, as the release ships it) to a
    transformers-saved tiny checkpoint and set ``num_nextn_predict_layers`` 1. The decoder-layer tensors
    are those transformers writes for an extra layer of the given type; ``e_proj``/``h_proj``
    ([hidden, hidden]), ``enorm``/``hnorm``/``norm`` and the hc head (``hc_head_fn/base/scale``, float32)
    are drawn from their own generator, so the main model's tensors are unchanged."""
    import tempfile

    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    c = {**TINY_CONFIG, **overrides}
    n, h, hc = c["num_hidden_layers"], c["hidden_size"], c["hc_mult"]
    extra = build_tiny_model(
        seed + 100,
        **overrides,
        num_hidden_layers=n + 1,
        layer_types=list(c["layer_types"]) + [MTP_LAYER_TYPE],
        mlp_layer_types=list(c["mlp_layer_types"]) + [MTP_MLP_TYPE],
    )
    with tempfile.TemporaryDirectory() as tmp:
        extra.save_pretrained(tmp, safe_serialization=True)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    tensors = load_file(str(out / "model.safetensors"))
    layer = f"model.layers.{n}."
    tensors.update({"mtp.0." + k[len(layer) :]: v.contiguous() for k, v in saved.items() if k.startswith(layer)})
    g = torch.Generator().manual_seed(seed + 101)
    tensors["mtp.0.e_proj.weight"] = torch.randn(h, h, generator=g) * h**-0.5
    tensors["mtp.0.h_proj.weight"] = torch.randn(h, h, generator=g) * h**-0.5
    for norm in ("enorm", "hnorm", "norm"):
        tensors[f"mtp.0.{norm}.weight"] = 1.0 + 0.2 * torch.randn(h, generator=g)
    tensors["mtp.0.hc_head_fn"] = torch.randn(hc, hc * h, generator=g) * 0.1
    tensors["mtp.0.hc_head_base"] = torch.randn(hc, generator=g) * 0.5
    tensors["mtp.0.hc_head_scale"] = 1.0 + torch.rand(1, generator=g)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


# ---------------------------------------------------------------- DeepSeek's own release layout
_NATIVE_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
# FP8 e4m3 block-scaled in the release: attention linears (indexer query included) and the shared expert.
RELEASE_FP8 = re.compile(
    r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.shared_experts\.w[123]\.weight$|^mtp\.\d+\.[eh]_proj\.weight$"
)
RELEASE_FP4 = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
# BF16 without a scale: compressor / indexer-compressor projections and the indexer's weights_proj.
RELEASE_BF16_PROJ = re.compile(r"\.compressor\.(wkv|wgate)\.weight$|\.indexer\.weights_proj\.weight$")
RELEASE_F32 = re.compile(r"(hc_(attn|ffn)_(fn|base|scale)|hc_head_(fn|base|scale)|attn_sink|\.ape|gate\.bias)$")
BLOCK = 128


def native_name(saved: str) -> str:
    """transformers-saved tiny name -> DeepSeek's native name (no ``model.`` prefix)."""
    n = saved.removeprefix("model.")
    return {
        "embed_tokens.weight": "embed.weight",
        "lm_head.weight": "head.weight",
        "hc_head.hc_fn": "hc_head_fn",
        "hc_head.hc_base": "hc_head_base",
        "hc_head.hc_scale": "hc_head_scale",
    }.get(n, n)


def native_config(overrides: dict | None = None, mtp: bool = True) -> dict:
    """DeepSeek's own config.json keys for the tiny architecture (HCA rate 128, as DeepSeek can express);
    with ``mtp``, the MTP layer's entry after the main layers' compress ratios."""
    c = TINY_CONFIG
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        **{k: c[k] for k in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers")},
        **{k: c[k] for k in ("num_attention_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank")},
        **{k: c[k] for k in ("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "norm_topk_prob")},
        **{k: c[k] for k in ("routed_scaling_factor", "swiglu_limit", "sliding_window", "rope_theta")},
        **{k: c[k] for k in ("compress_rope_theta", "max_position_embeddings", "index_n_heads", "index_head_dim")},
        **{k: c[k] for k in ("index_topk", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps")},
        "num_key_value_heads": 1,
        "qk_rope_head_dim": int(c["head_dim"] * c["partial_rotary_factor"]),
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "num_hash_layers": sum(t == "hash_moe" for t in c["mlp_layer_types"]),
        "compress_ratios": [_NATIVE_RATIO[t] for t in c["layer_types"]]
        + ([_NATIVE_RATIO[MTP_LAYER_TYPE]] if mtp else []),
        "rope_scaling": {"type": "yarn", **{k: v for k, v in c["rope_parameters"].items() if k != "rope_type"}},
        "num_nextn_predict_layers": int(mtp),
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    return {**cfg, **(overrides or {})}


def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest power of two s with amax / s <= qmax (an exact F8_E8M0 value)."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30) / qmax)))


def quantize_fp8_block(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (F8_E4M3 [out, in], F8_E8M0 [ceil(out/B), ceil(in/B)]), the release's encoding."""
    out, inp = w.shape
    rows, cols = -(-out // block), -(-inp // block)
    pad = torch.zeros(rows * block, cols * block)
    pad[:out, :inp] = w.float()
    amax = pad.view(rows, block, cols, block).abs().amax(dim=(1, 3))
    s = _pow2_scale(amax, 448.0)
    full = s.repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inp]
    return (w.float() / full).to(torch.float8_e4m3fn), s.to(torch.float8_e8m0fnu)


_E2M1_POS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_fp4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (int8 [out, in/2] two e2m1 codes per byte, low nibble first; F8_E8M0 [out, in/group])."""
    out, inp = w.shape
    g = w.float().view(out, inp // group, group)
    s = _pow2_scale(g.abs().amax(-1), 6.0)
    v = g / s[..., None]
    code = (v.abs()[..., None] - _E2M1_POS).abs().argmin(-1) | ((v < 0).long() << 3)
    code = code.view(out, inp)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, s.to(torch.float8_e8m0fnu)


def write_release(src_dir: str | Path, out_dir: str | Path) -> Path:
    """DeepSeek's published layout from a transformers-saved tiny (HCA rate 128): native names, FP8
    block-scaled attention / shared-expert linears (and the MTP layer's ``e_proj``/``h_proj``), FP4 routed
    experts, BF16 compressor / indexer projections, F32 mHC / sinks / ape / router bias, BF16 rest, the MTP
    layer ``mtp.0.*`` when the source has one (``make_tiny(mtp=True)``), and a native config.json with the
    release's ``quantization_config``."""
    from safetensors.torch import load_file, save_file

    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for saved, t in load_file(str(src / "model.safetensors")).items():
        n = native_name(saved)
        base = n[: -len(".weight")]
        if RELEASE_FP8.search(n):
            tensors[n], tensors[f"{base}.scale"] = quantize_fp8_block(t)
        elif RELEASE_FP4.search(n):
            tensors[n], tensors[f"{base}.scale"] = quantize_fp4(t)
        elif t.dtype == torch.int64 or RELEASE_F32.search(n):
            tensors[n] = t
        else:  # BF16: embed, head, norms, router weight, compressor / indexer projections
            tensors[n] = t.to(torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            (out / f).write_bytes((src / f).read_bytes())
    cfg = native_config(
        mtp=any(n.startswith("mtp.") for n in tensors),
        overrides={
            "quantization_config": {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "scale_fmt": "ue8m0",
                "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK],
            }
        },
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
