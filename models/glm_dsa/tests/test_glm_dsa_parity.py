"""GLM-5.x DSA through real vLLM (CPU) against transformers' own GlmMoeDsaForCausalLM.

Dense: contexts up to index_topk (dense attention is exact there), batched and
chunked prefill. Sparse: index_topk 8 with prompts many times longer, served
with a long max_model_len and no extra flags (the portable sparse path is
chosen automatically), also chunked and batched.
"""

from __future__ import annotations

import pytest
from _glm_dsa_ref import Reference, build, random_prompts

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.testing.parity import compare, vllm_logits

TOL = 1e-3


@pytest.fixture(scope="module")
def dense_ckpt(tmp_path_factory):
    return build(tmp_path_factory.mktemp("glm_dsa"), "tiny-dense", index_topk=64)


@pytest.fixture(scope="module")
def sparse_ckpt(tmp_path_factory):
    return build(tmp_path_factory.mktemp("glm_dsa"), "tiny-sparse", index_topk=8)


def _record_parity(rec, label, rep):
    rec.metric(f"{label}_max_abs_diff", rep.max_abs_diff)
    rec.check(f"{label}: logits within {TOL} at every position", rep.max_abs_diff <= TOL, rep.as_dict())
    rec.check(f"{label}: greedy tokens identical", rep.tokens_identical, rep.first_divergence)


@pytest.mark.vllm
@pytest.mark.gate
def test_dense_parity_batched_chunked(dense_ckpt, evidence_root):
    rec = EvidenceRecord(model="glm_dsa", gate="parity_dense")
    prompts = random_prompts([3, 17, 40, 52], seed=1)
    kwargs = {"max_model_len": 64, "max_num_batched_tokens": 16, "max_num_seqs": 4, "block_size": 16}
    runs = vllm_logits(dense_ckpt, [prompts, [prompts[3]], [prompts[0]]], max_tokens=10, llm_kwargs=kwargs)
    rec.command(
        f"vllm.LLM({dense_ckpt.name}, dtype=float32, enforce_eager, {kwargs}) raw logits; "
        "batch of 4 (chunked prefill, 16 tokens/step) then single prompts"
    )
    ref = Reference(dense_ckpt)
    batched, single_long, single_short = (compare(r, ref) for r in runs)
    _record_parity(rec, "batched+chunked", batched)
    _record_parity(rec, "single (52-token prompt, chunked)", single_long)
    _record_parity(rec, "single (3-token prompt)", single_short)
    same = runs[0][3].gen_ids == runs[1][0].gen_ids and runs[0][0].gen_ids == runs[2][0].gen_ids
    rec.check("batched tokens equal the single-prompt tokens", same)
    rec.notes.append(
        "checkpoint saved by transformers' GlmMoeDsaForCausalLM.save_pretrained, plus the released "
        "export's rot.weight and one MTP layer (skipped by name)"
    )
    rec.write(evidence_root)
    assert batched.max_abs_diff <= TOL and single_long.max_abs_diff <= TOL and single_short.max_abs_diff <= TOL
    assert batched.tokens_identical and single_long.tokens_identical and single_short.tokens_identical and same


@pytest.mark.vllm
@pytest.mark.gate
def test_sparse_parity_beyond_index_topk(sparse_ckpt, evidence_root):
    rec = EvidenceRecord(model="glm_dsa", gate="parity_sparse")
    prompts = random_prompts([3, 21, 64, 100], seed=2)
    kwargs = {"max_model_len": 160, "max_num_batched_tokens": 32, "max_num_seqs": 4, "block_size": 16}
    runs = vllm_logits(sparse_ckpt, [prompts, [prompts[3]]], max_tokens=12, llm_kwargs=kwargs)
    rec.command(
        f"vllm.LLM({sparse_ckpt.name}, dtype=float32, enforce_eager, {kwargs}) raw logits; no extra flags "
        "(index_topk=8, so the portable sparse path is chosen)"
    )
    ref = Reference(sparse_ckpt)
    batched, single = compare(runs[0], ref), compare(runs[1], ref)
    _record_parity(rec, "sparse batched+chunked", batched)
    _record_parity(rec, "sparse single (100-token prompt)", single)
    same = runs[0][3].gen_ids == runs[1][0].gen_ids
    rec.check("batched tokens equal the single-prompt tokens", same)

    # the selection must matter: a dense reference on the same weights differs beyond index_topk
    dense_ref = Reference(sparse_ckpt, index_topk=10_000)
    seq = runs[0][3]
    ids = seq.positions_ids
    diff_dense = float((dense_ref(ids)[8:] - ref(ids)[8:]).abs().max())
    rec.metric("sparse_vs_dense_reference_max_diff_beyond_topk", diff_dense)
    rec.check("sparse selection changes the logits (dense reference differs by > 0.1)", diff_dense > 0.1)
    gap = ref.topk_boundary_gap(ids)
    rec.metric("reference_topk_boundary_min_gap", gap)
    rec.check("no exact ties at the top-k boundary in the reference (gap > 0)", gap > 0)
    rec.write(evidence_root)
    assert batched.max_abs_diff <= TOL and single.max_abs_diff <= TOL
    assert batched.tokens_identical and single.tokens_identical and same
    assert diff_dense > 0.1 and gap > 0
