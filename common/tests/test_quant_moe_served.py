"""Per-expert W8A8_DYNAMIC MoE export (our documented-math exporter) served by vLLM's own Qwen3MoeForCausalLM.

msmodelslim cannot quantize the routed experts of a tiny MoE model faithfully (docs/references.md#msmodelslim-tiny-moe), so
``testing.modelslim.export_w8a8`` writes the documented per-expert layout. vLLM's fused-MoE layer
then runs the ``modelslim`` MoE method (routing, expert grouping, zero-token experts). Reference:
transformers' Qwen3-MoE with the export's tensors, attention linears and every expert applied in
plain torch from the documented equations; and the float model (greedy agreement, logit error).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from ascend_adapters.common.evidence import EvidenceRecord  # noqa: E402
from ascend_adapters.testing.factory import make_checkpoint  # noqa: E402
from ascend_adapters.testing.modelslim import (  # noqa: E402
    ReferenceLinear,
    export_w8a8,
    load_export,
    patch_linears,
    split_fused_experts,
)
from ascend_adapters.testing.parity import compare, vllm_logits  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.gate]

E, TOP_K = 8, 2
REF_MAX_ABS = 2e-3
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


class _ReferenceExperts(torch.nn.Module):
    """transformers' Qwen3MoeExperts interface; each expert's linears from the export in plain torch."""

    def __init__(self, tensors, description, prefix):
        super().__init__()
        self.experts = [
            {
                p: ReferenceLinear(tensors, description, f"{prefix}.{e}.{p}")
                for p in ("gate_proj", "up_proj", "down_proj")
            }
            for e in range(E)
        ]

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for t in range(hidden_states.shape[0]):
            for j in range(top_k_index.shape[1]):
                ex = self.experts[int(top_k_index[t, j])]
                x = hidden_states[t : t + 1]
                a = torch.nn.functional.silu(ex["gate_proj"](x)) * ex["up_proj"](x)
                out[t] += ex["down_proj"](a)[0] * top_k_weights[t, j]
        return out


def _quant_reference(export_dir):
    cfg = transformers.AutoConfig.from_pretrained(export_dir)
    cfg._attn_implementation = "eager"
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.float32).eval()
    patch_linears(model, export_dir)  # FLOAT tensors + quantized attention linears
    tensors, description = load_export(export_dir)
    for i, layer in enumerate(model.model.layers):
        layer.mlp.experts = _ReferenceExperts(tensors, description, f"model.layers.{i}.mlp.experts")
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

    rep = compare(batched, _run(_quant_reference(export)))
    rec.metric("reference_max_abs_logit_diff", rep.max_abs_diff)
    rec.metric("per_sequence", rep.per_sequence)
    ok_a = rec.check(
        "(a) logits match the plain-torch per-expert reference",
        rep.max_abs_diff <= REF_MAX_ABS and rep.tokens_identical,
        {"max_abs_diff": rep.max_abs_diff, "bound": REF_MAX_ABS},
    )
    bdiff = float((batched[0].logits - single[0].logits).abs().max())
    ok_batch = rec.check("batched and single runs agree", bdiff <= REF_MAX_ABS, {"max_abs_diff": bdiff})

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
        f"MoE: reference max|d|={rep.max_abs_diff:.3g}, batched-vs-single {bdiff:.3g}, "
        f"vs float agreement {agree / total:.3f} max err {max_err:.3g}"
    )
    assert ok_a, rep.as_dict()
    assert ok_batch, bdiff
    assert ok_b, (agree, total, max_err)
