"""Gate: RWKV-7 with tensor parallelism 2 (CPU, float32) against the official `rwkv` package.

The heads are split across two ranks (each holds 2 of the 4 heads, their WKV states and
a column slice of every projection); the row-parallel output projections all-reduce.
The checks are those of the single-rank parity gate at the same bound: four prompts of
5..90 tokens batched, with ``max_num_batched_tokens=32`` (chunked prefill mixed with
decodes), then each alone. A head count the ranks cannot split is refused at start-up.
"""

from __future__ import annotations

import pytest
import torch
from _rwkv7_cases import CASES, TP_CASES, build_case, engine_configs, prompts
from _rwkv7_ref import rwkv_package_logits

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.testing.parity import compare, vllm_logits

LENGTHS = (5, 19, 45, 90)
MAX_TOKENS = 8
BATCHED_TOKENS = 32
TP = 2
LLM_KWARGS = {
    "max_num_batched_tokens": BATCHED_TOKENS,
    "max_num_seqs": 8,
    "max_model_len": 256,
    "tensor_parallel_size": TP,
}
# vLLM's CPU workers pin their OpenMP threads; one core per rank
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
# The same bound as the single-rank gate (test_rwkv7_parity.py): splitting the heads changes only
# the summation order of the row-parallel projections (two partial sums, then the all-reduce),
# float32 rounding of the same size as the single-rank path's.
TOL = 1e-4
CASE = "h32x4_l2"


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("rwkv7-tp")
    spec = TP_CASES[CASE]
    pth, hf_dir = build_case(root, CASE)
    ps = prompts(spec["vocab"], LENGTHS, seed=spec["seed"])
    runs = vllm_logits(hf_dir, [ps] + [[p] for p in ps], max_tokens=MAX_TOKENS, llm_kwargs=LLM_KWARGS, env=ENV)
    seqs = [s for batch in runs for s in batch]
    ref_rows = rwkv_package_logits(pth, [s.positions_ids for s in seqs])
    table = {tuple(s.positions_ids): r for s, r in zip(seqs, ref_rows)}
    reports = {
        "batched": compare(runs[0], lambda ids: table[tuple(ids)]),
        "alone": compare([b[0] for b in runs[1:]], lambda ids: table[tuple(ids)]),
    }
    return {"spec": spec, "runs": runs, "reports": reports}


@pytest.mark.vllm
def test_tp2_logits_match_rwkv_package(result):
    for mode, rep in result["reports"].items():
        assert rep.max_abs_diff < TOL, (mode, rep.as_dict())
        assert rep.tokens_identical, (mode, rep.first_divergence)


@pytest.mark.vllm
def test_tp2_batch_equals_each_alone_and_chunked_prefill_matches(result):
    runs = result["runs"]
    for i, seq in enumerate(runs[0]):
        alone = runs[1 + i][0]
        assert seq.gen_ids == alone.gen_ids, f"prompt {i}"
        assert torch.allclose(seq.logits, alone.logits, atol=TOL, rtol=0)
    long_ones = [s for s in result["reports"]["alone"].per_sequence if s["prompt_len"] > BATCHED_TOKENS]
    assert len(long_ones) >= 2 and all(s["max_abs_diff"] < TOL for s in long_ones), long_ones


@pytest.mark.vllm
def test_head_count_not_divisible_by_tp_is_refused(tmp_path):
    _, three_heads = build_case(tmp_path, "h32x3_l2")
    assert CASES["h32x3_l2"]["n_embd"] // CASES["h32x3_l2"]["head_size"] == 3
    got = engine_configs([["tp2", str(three_heads), {"tensor_parallel_size": 2}]], tmp_path)
    # one line (vLLM wraps it in its config validation error) naming both numbers
    line = "RWKV-7 adapter: tensor parallelism splits heads across ranks: 3 heads are not divisible by "
    assert line + "tensor_parallel_size=2" in got["tp2"], got["tp2"]


@pytest.mark.vllm
@pytest.mark.gate
def test_tp2_parity_gate_evidence(result, evidence_root):
    rec = EvidenceRecord(model="rwkv7", gate="tp2_parity")
    rec.command("python -m ascend_adapters.rwkv7.convert SRC.pth OUT_DIR  (tiny random BlinkDL checkpoint, 4 heads)")
    rec.command(
        f"VLLM_CPU_OMP_THREADS_BIND='0|1' vllm.LLM(OUT_DIR, dtype=float32, enforce_eager=True, "
        f"tensor_parallel_size={TP}, max_num_batched_tokens={BATCHED_TOKENS}, max_num_seqs=8, "
        "logprobs_mode=raw_logits) greedy, 4 prompts batched then each alone"
    )
    rec.command("rwkv.model.RWKV(SRC, 'cpu fp32') with RWKV_V7_ON=1 RWKV_CUDA_ON=0")
    rep_b, rep_a = result["reports"]["batched"], result["reports"]["alone"]
    worst = max(rep_b.max_abs_diff, rep_a.max_abs_diff)
    rec.metric("shape", result["spec"])
    rec.metric("tensor_parallel_size", TP)
    rec.metric("prompt_lengths", list(LENGTHS))
    rec.metric("max_abs_logit_diff", worst)
    ok = rec.check(f"TP={TP}: logits within {TOL} at every prompt position and generated step", worst < TOL)
    ok &= rec.check(
        f"TP={TP}: greedy tokens identical to the rwkv package",
        rep_b.tokens_identical and rep_a.tokens_identical,
        rep_b.first_divergence or rep_a.first_divergence,
    )
    same = all(b.gen_ids == a[0].gen_ids for b, a in zip(result["runs"][0], result["runs"][1:]))
    ok &= rec.check(f"TP={TP}: concurrent batch of different lengths == each alone", same)
    ok &= rec.check(
        f"TP={TP}: prompts > max_num_batched_tokens (chunked prefill) match",
        all(s["max_abs_diff"] < TOL for s in rep_a.per_sequence if s["prompt_len"] > BATCHED_TOKENS),
    )
    rec.skip("NPU kernels and HCCL", "no Ascend NPU here; two CPU ranks (gloo/shared-memory all-reduce) ran")
    path = rec.write(evidence_root)
    assert ok and path.exists()
