"""Per-expert W8A8_DYNAMIC MoE export (our documented-math exporter) served by vLLM's own Qwen3MoeForCausalLM.

msmodelslim cannot quantize the routed experts of a tiny MoE model faithfully (docs/references.md#msmodelslim-tiny-moe), so
``testing.modelslim.export_w8a8`` writes the documented per-expert layout. vLLM's fused-MoE layer
then runs the ``modelslim`` MoE method (routing, expert grouping, zero-token experts). Reference:
transformers' Qwen3-MoE on the float checkpoint, quantized by the test from ModelSlim's published
equations (``testing.w8a8_reference``: no exported tensor, no exporter or kernel function); and the
float model (greedy agreement, logit error).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from ascend_adapters.common.evidence import EvidenceRecord  # noqa: E402
from ascend_adapters.testing.factory import make_checkpoint  # noqa: E402
from ascend_adapters.testing.modelslim import export_w8a8, load_export, split_fused_experts  # noqa: E402
from ascend_adapters.testing.parity import vllm_logits  # noqa: E402
from ascend_adapters.testing.w8a8_reference import (  # noqa: E402
    FOLLOWING,
    DynamicExperts,
    compare_within_rounding,
    quantize_linear,
)

pytestmark = [pytest.mark.vllm, pytest.mark.gate]

E, TOP_K = 8, 2
# Both sides put the same weights and activations on the same int8 grids and multiply integers exactly;
# what is left is float32 rounding of the float parts (attention, norms, residuals, scales): u = 2^-24,
# reductions of K <= 256 terms ~sqrt(K) u, 2 layers x ~4 stages: 8 * 16 * 6e-8 ~ 8e-6 relative, times
# max|logit| <= 10 -> 1e-4. Where that rounding can push an activation across an int8 rounding boundary,
# the comparison follows the rounding the served model took (testing.w8a8_reference).
REF_MAX_ABS = 1e-4
PLAN = {"model.layers.*.mlp.experts.*": "W8A8_DYNAMIC", "model.layers.*.self_attn.*_proj": "W8A8_DYNAMIC"}


def _config() -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512,
        "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "num_experts": E,
        "num_experts_per_tok": TOP_K, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "float32", "attention_bias": False,
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
    }  # fmt: skip


def _float_checkpoint(out_dir):
    """A seeded transformers Qwen3-MoE, written in the per-expert (hub) layout."""
    cfg = _config()
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.05)
    tensors = {k: v for name, t in model.state_dict().items() for k, v in split_fused_experts(name, t.clone())}
    make_checkpoint(out_dir, cfg, tensors)
    return model


def _independent_reference(float_dir):
    """transformers' Qwen3-MoE on the float checkpoint, every linear PLAN quantizes put through
    ``testing.w8a8_reference`` (ModelSlim's W8A8_DYNAMIC equations; no exported tensor, no exporter or
    kernel function)."""
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(
        str(float_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            quantize_linear(layer.self_attn, name)
        layer.mlp.experts = DynamicExperts(layer.mlp.experts)
    return model


def _run(model):
    def f(ids):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float()

    return f


def test_per_expert_w8a8_dynamic_moe_served(tmp_path, evidence_root):
    float_model = _float_checkpoint(tmp_path / "float")
    export = export_w8a8(tmp_path / "float", tmp_path / "w8a8", PLAN)
    tensors, description = load_export(export)
    assert tensors["model.layers.1.mlp.experts.7.down_proj.weight"].dtype == torch.int8
    assert description["model.layers.1.mlp.experts.7.down_proj.weight_offset"] == "W8A8_DYNAMIC"
    assert description["model.layers.0.mlp.gate.weight"] == "FLOAT"

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (6, 19, 33)]
    rec = EvidenceRecord(model="common-quant", gate="modelslim-w8a8-dynamic-moe-tiny-qwen3moe")
    rec.command("export_w8a8(<tiny Qwen3-MoE>, plan=" + repr(PLAN) + ")")
    rec.command("vllm.LLM(model=<export>, quantization='modelslim', dtype='float32', enforce_eager=True)")
    batched, single = vllm_logits(
        export, [prompts, [prompts[0]]], max_tokens=6, llm_kwargs={"quantization": "modelslim"}
    )

    quant = _independent_reference(tmp_path / "float")
    rep = compare_within_rounding([(r.prompt_ids, r.gen_ids, r.logits) for r in batched], _run(quant), REF_MAX_ABS)
    rec.metric("reference_max_abs_logit_diff", rep["max_abs_diff"])
    rec.metric("per_sequence", rep["per_sequence"])
    ok_a = rec.check(
        f"(a) logits within {REF_MAX_ABS} of the independently quantized per-expert reference, {FOLLOWING}; "
        "greedy tokens identical",
        rep["within_bound"] and rep["tokens_identical"],
        rep["per_sequence"],
    )
    # the same engine on a smaller batch: float32 sums regrouped, the same bound
    rep_single = compare_within_rounding(
        [(r.prompt_ids, r.gen_ids, r.logits) for r in single], _run(quant), REF_MAX_ABS
    )
    ok_batch = rec.check(
        f"the prompt alone (a smaller batch) also within {REF_MAX_ABS} of the reference, {FOLLOWING}",
        rep_single["within_bound"],
        rep_single["per_sequence"],
    )

    float_ref = _run(float_model)
    agree = total = 0
    max_err = 0.0
    for seq in batched:
        ref = float_ref(seq.positions_ids)
        got = seq.logits[:, : ref.shape[-1]]
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        total += ref.shape[0]
        max_err = max(max_err, float((ref - got).abs().max()))
    rec.metric("vs_float_greedy_agreement_all_positions", agree / total)
    rec.metric("vs_float_max_abs_logit_error", max_err)
    ok_b = rec.check(
        "(b) greedy tokens mostly agree with the float model",
        agree / total >= 0.75,
        {"agreement": agree / total, "positions": total, "max_abs_logit_error": max_err},
    )
    rec.write(evidence_root)
    print(
        f"MoE: reference max|d|={rep['max_abs_diff']:.3g}, alone {rep_single['max_abs_diff']:.3g}, "
        f"vs float agreement {agree / total:.3f} max err {max_err:.3g}"
    )
    assert ok_a, rep
    assert ok_batch, rep_single
    assert ok_b, (agree, total, max_err)
