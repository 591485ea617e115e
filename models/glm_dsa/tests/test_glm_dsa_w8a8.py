"""A ModelSlim W8A8 export of the tiny GLM-DSA served by vLLM (CPU, portable sparse path) against
transformers' model on the float checkpoint, quantized by the test from ModelSlim's published equations
(``_glm_dsa_w8a8.independent_reference``: it reads no exported tensor and shares no function with the
exporter or the kernels).

The export comes from common's documented-math exporter (see _glm_dsa_w8a8.py for why not msmodelslim):
static W8A8 attention linears (kv_b_proj FLOAT, as released), W8A8_DYNAMIC routed + shared experts,
FLOAT elsewhere.
"""

from __future__ import annotations

import json

import pytest
from _glm_dsa_ref import Reference, build, random_prompts
from _glm_dsa_w8a8 import compare_within_rounding, independent_reference, make_export

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.testing.parity import compare, vllm_logits
from ascend_adapters.testing.w8a8_reference import FOLLOWING

# Both sides put the same weights and activations on the same int8 grids (the reference from the float
# checkpoint, the export's integers from the exporter); the served integer products are exact and so are the
# reference's, so what is left is float32 rounding of the float parts (attention, norms, residuals, scales) in
# two implementations: u = 2^-24, reductions of K <= 256 terms accumulating ~sqrt(K) u, over 3 layers x ~4
# stages = 12 stages: 12 * 16 * 6e-8 ~ 1.2e-5 relative, times max|logit| <= 8 -> 1e-4. Where that rounding
# can push an activation across an int8 rounding boundary, the bound adds the reference's own measured
# roundings (_glm_dsa_w8a8.compare_within_rounding).
TOL = 1e-4


@pytest.mark.vllm
@pytest.mark.gate
def test_w8a8_export_parity(tmp_path, evidence_root):
    rec = EvidenceRecord(model="glm_dsa", gate="parity_w8a8")
    src = build(tmp_path, "src", index_topk=8)
    export = make_export(src, tmp_path / "w8a8", n_layers=3)
    desc = json.loads((export / "quant_model_description.json").read_text())
    kinds = {}
    for k, v in desc.items():
        if k.endswith(".weight"):
            kinds[v] = kinds.get(v, 0) + 1
    rec.metric("description_weight_types", kinds)
    prompts = random_prompts([5, 30], seed=5)
    kwargs = {"max_model_len": 96, "block_size": 16, "max_num_batched_tokens": 16, "quantization": "modelslim"}
    runs = vllm_logits(export, [prompts], max_tokens=8, llm_kwargs=kwargs)
    rec.command(f"vllm.LLM(<export>, {kwargs}) raw logits (sparse path: max_model_len 96 > index_topk 8)")
    quant = compare_within_rounding(
        [(r.prompt_ids, r.gen_ids, r.logits) for r in runs[0]], independent_reference(src, n_layers=3), TOL
    )
    plain = compare(runs[0], Reference(src))
    rec.metric("max_abs_diff_vs_quantized_reference", quant["max_abs_diff"])
    rec.metric("max_abs_diff_vs_float_model", plain.max_abs_diff)
    ok_tol = quant["within_bound"]
    ok_rel = quant["max_abs_diff"] <= 0.1 * plain.max_abs_diff
    rec.check(f"logits within {TOL} of the independently quantized reference at every position, {FOLLOWING}",
              ok_tol, quant["per_sequence"])  # fmt: skip
    rec.check("greedy tokens identical to the quantized reference", quant["tokens_identical"], quant["per_sequence"])
    rec.check("the quantization is really applied (float model differs 10x more)", ok_rel)
    rec.notes.append(
        "export written by ascend_adapters.testing.modelslim.export_w8a8 (documented math), "
        "not msmodelslim: msmodelslim cannot quantize a tiny GLM-DSA faithfully (docs/references.md#msmodelslim-tiny-moe)"
    )
    rec.notes.append("quantization selected with quantization='modelslim' (explicit)")
    rec.write(evidence_root)
    assert kinds.get("W8A8", 0) == 12 and kinds.get("W8A8_DYNAMIC", 0) >= 3 * 16
    assert ok_tol and ok_rel and quant["tokens_identical"], quant
