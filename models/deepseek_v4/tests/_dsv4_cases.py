"""Shared helpers for the DeepSeek-V4 tests: tiny checkpoints, native-layout conversion, the reference."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import torch

from ascend_adapters.deepseek_v4.tiny import TINY_CONFIG, make_tiny
from ascend_adapters.testing.modelslim import DEEPSEEK_V4_W8A8_PLAN as W8A8_PLAN  # noqa: F401  (for the tests)
from ascend_adapters.testing.parity import compare
from ascend_adapters.testing.w8a8_reference import FOLLOWING, DynamicExperts, compare_within_rounding, quantize_linear

# DeepSeek's own config keys for the same architecture (as in DeepSeek-V4 releases).
_NATIVE_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def prompts(lengths, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_model(model_dir):
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def reference_fn(model):
    """ids -> logits [len(ids), V] from transformers' DeepseekV4ForCausalLM (one uncached forward)."""

    def ref(ids):
        with torch.no_grad():
            return model(torch.tensor([list(ids)])).logits[0].float()

    return ref


def kv8_reference_fn(model, cache_dtype: str = "fp8"):
    """``reference_fn`` with the model's cache written in 8 bits: transformers' own DynamicCache for the
    config, its sliding-window K=V rows (``update``) and its compressed entries and indexer keys
    (``update_compressor_states``) put through ``testing.kv8_reference.ROUND_TRIPS[cache_dtype]`` as they
    are stored; the compressors' pending windows are not (the adapter keeps those in the model dtype)."""
    from transformers import DynamicCache

    from ascend_adapters.testing.kv8_reference import ROUND_TRIPS

    round_trip = ROUND_TRIPS[cache_dtype]

    class Kv8WriteCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            q = round_trip(key_states)  # K = V: one tensor
            return super().update(q, q, layer_idx, *args, **kwargs)

    def quantised_entries(layer):
        store = layer.update_compressor_states
        return lambda name, compressed: store(name, round_trip(compressed))

    def ref(ids):
        cache = Kv8WriteCache(config=model.config)
        for layer in cache.layers:
            if hasattr(layer, "update_compressor_states"):
                layer.update_compressor_states = quantised_entries(layer)
        with torch.no_grad():
            return model(torch.tensor([list(ids)]), past_key_values=cache).logits[0].float()

    return ref


def hf_greedy(model, ids, n: int, ref=None) -> list[int]:
    """Greedy continuation by repeated uncached forwards (no generate() cache involved); ``ref``: the
    forward (default ``reference_fn(model)``; ``kv8_reference_fn(model)`` for the 8-bit cache)."""
    ids, out = list(ids), []
    ref = ref or reference_fn(model)
    for _ in range(n):
        nxt = int(ref(ids)[-1].argmax())
        out.append(nxt)
        ids.append(nxt)
    return out


# DeepSeek-V4-Flash's rope set (its config.json): yarn over 65536 positions x 16 = 1M
FLASH_YARN = {"factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}


def make_native_hca128(out_dir: Path, seed: int = 3, long_context: bool = False) -> tuple[Path, Path]:
    """A transformers-saved tiny with HCA rate 128 (expressible in DeepSeek's keys), and its
    conversion to DeepSeek's native layout: native config keys, native tensor names without the
    ``model.`` prefix, layer 0 with a fused ``fused_wqa_wkv``, plus MTP tensors the model must skip.
    ``long_context``: Flash's rope set and 1M max_position_embeddings. Returns (transformers_dir, native_dir)."""
    from safetensors.torch import load_file, save_file

    yarn = FLASH_YARN if long_context else {k: v for k, v in TINY_CONFIG["rope_parameters"].items() if k != "rope_type"}
    max_positions = 1048576 if long_context else TINY_CONFIG["max_position_embeddings"]
    hf_dir = make_tiny(
        out_dir / ("hf128_1m" if long_context else "hf128"),
        seed=seed,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        rope_parameters={"rope_type": "yarn", **yarn},
        max_position_embeddings=max_positions,
    )
    native = out_dir / ("native_1m" if long_context else "native")
    native.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        n = name.removeprefix("model.")
        n = {
            "embed_tokens.weight": "embed.weight",
            "hc_head.hc_fn": "hc_head_fn",
            "hc_head.hc_base": "hc_head_base",
            "hc_head.hc_scale": "hc_head_scale",
        }.get(n, n)
        out[n] = t
    out["layers.0.attn.fused_wqa_wkv.weight"] = torch.cat(
        [out.pop("layers.0.attn.wq_a.weight"), out.pop("layers.0.attn.wkv.weight")], 0
    )
    g = torch.Generator().manual_seed(0)
    out["mtp.0.enorm.weight"] = torch.ones(TINY_CONFIG["hidden_size"])
    out["mtp.0.e_proj.weight"] = torch.randn(TINY_CONFIG["hidden_size"], TINY_CONFIG["hidden_size"], generator=g)
    out["mtp.0.attn.wq_a.weight"] = torch.randn(64, TINY_CONFIG["hidden_size"], generator=g)
    save_file(out, str(native / "model.safetensors"), metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (hf_dir / f).exists():
            (native / f).write_bytes((hf_dir / f).read_bytes())
    c = TINY_CONFIG
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": c["vocab_size"],
        "hidden_size": c["hidden_size"],
        "moe_intermediate_size": c["moe_intermediate_size"],
        "num_hidden_layers": c["num_hidden_layers"],
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": 1,
        "head_dim": c["head_dim"],
        "qk_rope_head_dim": int(c["head_dim"] * c["partial_rotary_factor"]),
        "q_lora_rank": c["q_lora_rank"],
        "o_groups": c["o_groups"],
        "o_lora_rank": c["o_lora_rank"],
        "n_routed_experts": c["n_routed_experts"],
        "n_shared_experts": c["n_shared_experts"],
        "num_experts_per_tok": c["num_experts_per_tok"],
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": c["routed_scaling_factor"],
        "swiglu_limit": c["swiglu_limit"],
        "num_hash_layers": sum(t == "hash_moe" for t in c["mlp_layer_types"]),
        "sliding_window": c["sliding_window"],
        # one entry per layer plus one for the MTP layer, as DeepSeek ships it
        "compress_ratios": [_NATIVE_RATIO[t] for t in c["layer_types"]] + [0],
        "rope_theta": c["rope_theta"],
        "compress_rope_theta": c["compress_rope_theta"],
        "rope_scaling": {"type": "yarn", **yarn},
        "max_position_embeddings": max_positions,
        "index_n_heads": c["index_n_heads"],
        "index_head_dim": c["index_head_dim"],
        "index_topk": c["index_topk"],
        "hc_mult": c["hc_mult"],
        "hc_sinkhorn_iters": c["hc_sinkhorn_iters"],
        "hc_eps": c["hc_eps"],
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": c["rms_norm_eps"],
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    (native / "config.json").write_text(json.dumps(cfg, indent=2))
    return hf_dir, native


# native linear name -> transformers module path (an explicit table, independent of the adapter's remap)
_NATIVE_TO_HF = {
    "attn.wq_a": "self_attn.q_a_proj",
    "attn.wkv": "self_attn.kv_proj",
    "attn.wq_b": "self_attn.q_b_proj",
    "attn.wo_b": "self_attn.o_b_proj",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
}
# the linears vLLM splits along their input under tensor parallelism (each rank quantizes its own slice)
_ROW_PARALLEL = {"attn.wo_b", "ffn.shared_experts.w2"}


def _quantized(plan: dict, name: str) -> bool:
    """The export plan's rule for a native linear name (the first matching entry wins)."""
    for pattern, kind in plan.items():
        if fnmatch.fnmatchcase(name, pattern.removesuffix(".weight")):
            return kind == "W8A8_DYNAMIC"
    return False


def w8a8_reference(float_dir, plan: dict, tensor_parallel: int = 1):
    """transformers' DeepseekV4ForCausalLM on the float checkpoint, every linear ``plan`` quantizes put through
    ``testing.w8a8_reference`` (ModelSlim's W8A8_DYNAMIC equations; no exported tensor, no exporter or kernel
    function), routed experts with transformers' own clamped SwiGLU between their projections.
    ``tensor_parallel``: the ranks a row-parallel linear's input is split over, each with its own scales."""
    model = hf_model(float_dir)
    for i, layer in enumerate(model.model.layers):
        for native, path in _NATIVE_TO_HF.items():
            if _quantized(plan, f"layers.{i}.{native}"):
                parent, _, child = path.rpartition(".")
                slices = tensor_parallel if native in _ROW_PARALLEL else 1
                quantize_linear(layer.get_submodule(parent), child, slices)
        if _quantized(plan, f"layers.{i}.ffn.experts.0.w1"):
            layer.mlp.experts = DynamicExperts(layer.mlp.experts, gate=layer.mlp.experts._apply_gate)
    return model


def compare_w8a8(sequences, model, tol: float) -> dict:
    """``testing.w8a8_reference.compare_within_rounding`` against ``model`` (a ``w8a8_reference``)."""
    return compare_within_rounding(sequences, reference_fn(model), tol)


def check_against_w8a8_reference(rec, split: str, res, float_dir, reference, reference_name: str, tol: float):
    """The checks of every W8A8 gate (the parity gate, PP=2, EP=2): the served logits ``res``
    (``parity.SeqLogits``) within ``tol`` of the independently quantized ``reference`` (a
    ``w8a8_reference``, following its near-boundary roundings), its greedy tokens, and logits that differ
    from the float model's by more than ``tol`` (the export really is int8); ``split`` names the
    parallel layout in the checks ("" for none). Returns (all passed, the reports)."""
    who = f"{split} " if split else ""
    int8_rep = compare_w8a8([(r.prompt_ids, r.gen_ids, r.logits) for r in res], reference, tol)
    float_rep = compare(res, reference_fn(hf_model(float_dir)))
    rec.metric("max_abs_diff_vs_int8_reference", int8_rep["max_abs_diff"])
    rec.metric("per_sequence_vs_int8_reference", int8_rep["per_sequence"])
    rec.metric("max_abs_diff_vs_float_model", float_rep.max_abs_diff)
    rec.metric("greedy_identical_to_float_model", float_rep.tokens_identical)
    rec.metric("float_model_first_divergence", float_rep.first_divergence)
    oks = [
        rec.check(
            f"{who}logits within {tol} of the {reference_name} at every position, {FOLLOWING}",
            int8_rep["within_bound"],
            int8_rep["per_sequence"],
        ),
        rec.check(f"{who}greedy tokens identical to the quantized reference", int8_rep["tokens_identical"]),
        rec.check(
            "the export really is int8 (logits differ from the float model)",
            float_rep.max_abs_diff > tol,
            f"{float_rep.max_abs_diff:.3e}",
        ),
    ]
    return all(oks), {"vs_int8_reference": int8_rep, "max_abs_diff_vs_float_model": float_rep.max_abs_diff}


def skipped_weights(model) -> dict:
    """Probe (``LLM.apply_model``): checkpoint name -> the reason the strict loader skipped it."""
    return dict(model.skipped_weights)


def pipeline_stage(model) -> dict:
    """Probe (``LLM.apply_model``, run on each worker): what this pipeline stage holds and skipped."""
    import re

    from vllm.model_executor.models.utils import PPMissingLayer

    from ascend_adapters.common import compat
    from ascend_adapters.common.loading import PIPELINE_STAGE_REASON

    m = model.model
    layers = range(m.start_layer, m.end_layer)
    to_model = compat.weights_mapper_fn(model.hf_to_vllm_mapper)  # checkpoint name -> this model's
    skipped = [to_model(n) for n, reason in model.skipped_weights.items() if reason == PIPELINE_STAGE_REASON]
    return {
        "layers": [m.start_layer, m.end_layer],
        "embed": not isinstance(m.embed_tokens, PPMissingLayer),
        "norm_hc_head_lm_head": [not isinstance(x, PPMissingLayer) for x in (m.norm, m.hc_head, model.lm_head)],
        "hash_tables": sorted(n for n, _ in model.named_buffers() if n.endswith(".tid2eid")),
        "skipped_layers": sorted({int(x) for n in skipped for x in re.findall(r"^model\.layers\.(\d+)\.", n)}),
        "skipped_ends": sorted({n.rsplit(".", 1)[0] for n in skipped if not n.startswith("model.layers.")}),
        # the paged caches vLLM bound to each of this stage's attention layers
        "caches_bound": {
            i: sorted(kind for kind, c in m.layers[i].self_attn.caches.items() if c.kv_cache.numel()) for i in layers
        },
    }
