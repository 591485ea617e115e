"""Gate: RWKV-7 served by vLLM (CPU, float32) against the official `rwkv` package.

Per tiny checkpoint (random BlinkDL .pth, converted with the converter), one
vLLM engine with ``max_num_batched_tokens=32`` runs four prompts of 5..90
tokens together, then each alone. Prompts longer than 32 tokens are prefilled
in several chunks, and the batched run mixes decodes with prefill chunks. The
`rwkv` package (x070 pure-torch path, ``cpu fp32``) gives the reference
logits for every prompt position and generated step.
"""

from __future__ import annotations

import time

import pytest
import torch
from _rwkv7_cases import CASES, build_case, prompts
from _rwkv7_ref import rwkv_package_logits

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.testing.parity import compare, vllm_logits

LENGTHS = (5, 19, 45, 90)
MAX_TOKENS = 8
BATCHED_TOKENS = 32
LLM_KWARGS = {"max_num_batched_tokens": BATCHED_TOKENS, "max_num_seqs": 8, "max_model_len": 256}
TOL = 1e-4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("rwkv7-parity")
    out = {"_started": time.time()}  # the gate's record covers this fixture's work (conversion, engine, reference)
    for name, spec in CASES.items():
        pth, hf_dir = build_case(root, name)
        ps = prompts(spec["vocab"], LENGTHS, seed=spec["seed"])
        runs = vllm_logits(hf_dir, [ps] + [[p] for p in ps], max_tokens=MAX_TOKENS, llm_kwargs=LLM_KWARGS)
        seqs = [s for batch in runs for s in batch]
        ref_rows = rwkv_package_logits(pth, [s.positions_ids for s in seqs])
        table = {tuple(s.positions_ids): r for s, r in zip(seqs, ref_rows)}
        reports = {
            "batched": compare(runs[0], lambda ids, t=table: t[tuple(ids)]),
            "alone": compare([b[0] for b in runs[1:]], lambda ids, t=table: t[tuple(ids)]),
        }
        out[name] = {"spec": spec, "prompts": ps, "runs": runs, "reports": reports, "hf_dir": hf_dir}
    return out


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_rwkv_package_at_every_position(results, case):
    for mode, rep in results[case]["reports"].items():
        assert rep.max_abs_diff < TOL, (mode, rep.as_dict())


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_identical_to_rwkv_package(results, case):
    for mode, rep in results[case]["reports"].items():
        assert rep.tokens_identical, (mode, rep.first_divergence)


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_concurrent_batch_equals_each_alone(results, case):
    runs = results[case]["runs"]
    for i, seq in enumerate(runs[0]):
        alone = runs[1 + i][0]
        assert seq.prompt_ids == alone.prompt_ids
        assert seq.gen_ids == alone.gen_ids, f"prompt {i} ({len(seq.prompt_ids)} tokens)"
        assert torch.allclose(seq.logits, alone.logits, atol=TOL, rtol=0)


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_chunked_prefill_prompt_matches(results, case):
    """Prompts longer than max_num_batched_tokens are prefilled over several engine steps."""
    reports = results[case]["reports"]
    long_ones = [s for s in reports["alone"].per_sequence if s["prompt_len"] > BATCHED_TOKENS]
    assert len(long_ones) >= 2 and max(s["prompt_len"] for s in long_ones) > 2 * BATCHED_TOKENS
    assert all(s["max_abs_diff"] < TOL and s["divergence"] is None for s in long_ones), long_ones


@pytest.mark.vllm
@pytest.mark.gate
def test_parity_gate_evidence(results, evidence_root):
    rec = EvidenceRecord(model="rwkv7", gate="parity", started=results["_started"])
    rec.command("ascend_adapters.rwkv7.convert.convert(SRC.pth, OUT_DIR) in process (tiny random BlinkDL checkpoints)")
    rec.command(
        f"vllm.LLM(OUT_DIR, dtype=float32, enforce_eager=True, max_num_batched_tokens={BATCHED_TOKENS}, "
        "max_num_seqs=8, logprobs_mode=raw_logits) greedy, 4 prompts batched then each alone"
    )
    rec.command("rwkv.model.RWKV(SRC, 'cpu fp32') with RWKV_V7_ON=1 RWKV_CUDA_ON=0 (rwkv 0.8.32)")
    ok = True
    for name, r in ((k, v) for k, v in results.items() if k in CASES):
        rep_b, rep_a = r["reports"]["batched"], r["reports"]["alone"]
        worst = max(rep_b.max_abs_diff, rep_a.max_abs_diff)
        rec.metric(f"{name}.shape", r["spec"])
        rec.metric(f"{name}.prompt_lengths", list(LENGTHS))
        rec.metric(f"{name}.max_abs_logit_diff", worst)
        ok &= rec.check(f"{name}: logits within {TOL} at every prompt position and generated step", worst < TOL)
        ok &= rec.check(
            f"{name}: greedy tokens identical to the rwkv package",
            rep_b.tokens_identical and rep_a.tokens_identical,
            rep_b.first_divergence or rep_a.first_divergence,
        )
        same = all(b.gen_ids == a[0].gen_ids for b, a in zip(r["runs"][0], r["runs"][1:]))
        ok &= rec.check(f"{name}: concurrent batch of different lengths == each alone", same)
        ok &= rec.check(
            f"{name}: prompts > max_num_batched_tokens (chunked prefill) match",
            all(s["max_abs_diff"] < TOL for s in rep_a.per_sequence if s["prompt_len"] > BATCHED_TOKENS),
        )
    rec.skip("NPU kernels", "no Ascend NPU here; the portable torch WKV step/chunk ran")
    rec.skip("released checkpoints", "no network to fetch weights; random tiny checkpoints with the real names/shapes")
    path = rec.write(evidence_root)
    assert ok and path.exists()
