"""Gate: DeepSeek-V4 served by vLLM in bfloat16 against transformers' DeepseekV4ForCausalLM in bfloat16.

Same tiny random checkpoint, same prompts (past the window, CSA and HCA entries), the reference run
on exactly the token ids vLLM saw, every prompt position and generated step compared.

The reference in bfloat16: ``from_pretrained(dtype=bfloat16)`` keeps the modules the model declares
float32 (norms, mHC, sinks, biases) and its CPU path then feeds a float32 norm output into a
bfloat16 linear (dtype mismatch, a failure seen here); ``torch.autocast("cpu",
bfloat16)`` supplies the bfloat16 cast at those linear inputs, nothing else changes.

Bound, from bfloat16 rounding (u = 2^-8): both sides compute the same function from the same
bfloat16 weights and differ only in where and in which order they round (on engines whose mHC ops
serve bfloat16, ``mhc.py`` serves mHC with vLLM's: its post op adds in float32 and rounds once,
where transformers rounds ``post``/``comb`` to bfloat16 first). How far rounding moves
this model's logits is measured on the independent side: ``E`` = max |transformers bf16 -
transformers fp32| over the compared positions. A second bfloat16 implementation that rounds
comparably is within ``E`` of the float32 result too, so the two bfloat16 runs differ by at most
``2 E`` (triangle inequality); a model error moves logits by O(|logit|).

That holds where the computation is continuous. Discrete choices (routed top-k experts, the CSA
indexer's top-k entries) flip when rounding reorders two nearly equal scores, and a flip moves the
logits by far more than rounding. So:

A. ``continuous``: the same weights with every choice made total (num_experts_per_tok = all 8
   experts, index_topk = 64 >= every CSA entry count at 256 tokens): nothing can flip, every
   position must be within 2 E.
B. ``discrete``: the shipped tiny config (top-2 of 8 experts, index_topk 4). Positions within
   ``2 E_A`` need nothing more; in every sequence the first position beyond it must come at or
   after a near-tie in the reference: a routing or indexer decision whose gap between the last
   chosen and the first rejected score is within 4 ``E_d``, ``E_d`` the reference's own bf16-vs-fp32
   difference of that decision's scores (``testing.bf16.decision_near_ties``). At least
   ``MIN_COMPARED`` positions must come before their sequence's first near-tie.
"""

from __future__ import annotations

import pytest
import torch
from _dsv4_cases import prompts

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.deepseek_v4.tiny import make_tiny
from ascend_adapters.testing.bf16 import (
    check_continuous,
    check_discrete,
    decision_near_ties,
    paired_sequences,
    rounding_scale,
)
from ascend_adapters.testing.parity import vllm_logits

pytestmark = [pytest.mark.vllm, pytest.mark.gate]

LENGTHS = (7, 61, 150)  # window 16; CSA rate 4; HCA rate 16
MAX_TOKENS = 4
SEED = 5
CONTINUOUS = {"num_experts_per_tok": 8, "index_topk": 64}  # 8 experts; 256 / 4 = 64 CSA entries at most
LLM_KWARGS = {"max_model_len": 256, "dtype": "bfloat16"}
# B compares the positions before each sequence's first near-tie: at least this many over the three
# sequences (the 7-token prompt alone has 10 positions), or the record compared too little to say anything.
MIN_COMPARED = 10


def _reference_logits(model_dir, seqs, dtype, hooks=None):
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    out, gaps = [], []
    for ids in seqs:
        rec = []
        handles = hooks(model, rec) if hooks else []
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out.append(model(torch.tensor([ids])).logits[0].float())
        for h in handles:
            h.remove()
        gaps.append(rec)
    return out, gaps


def _decisions(model, rec):
    """Every routed top-k and every indexer top-k decision of a forward: its scores per position, which
    candidates each position may choose from, and k (``testing.bf16.decision_near_ties``)."""
    handles = []
    for mod in model.modules():
        kind = type(mod).__name__
        if kind == "DeepseekV4TopKRouter":

            def router(m, inp, out):
                s = m.score_fn(out[0].float()) + m.e_score_correction_bias.float()
                rec.append({"scores": s, "valid": torch.ones_like(s, dtype=torch.bool), "k": m.top_k})

            handles.append(mod.register_forward_hook(router))
        elif kind == "DeepseekV4Indexer":

            def indexer(m, inp, out, rate=mod.compress_rate, k=mod.index_topk):
                sc = out[0].float()  # [S, T] before the causal mask
                seen = ((torch.arange(sc.shape[0]) + 1) // rate).clamp(max=sc.shape[1])  # entries each query sees
                rec.append({"scores": sc, "valid": torch.arange(sc.shape[1])[None, :] < seen[:, None], "k": k})

            handles.append(mod.scorer.register_forward_hook(indexer))
    return handles


def _serve_and_compare(model_dir, hooks=None):
    """Paired sequences, and per sequence the near-tie positions of the hooked decisions (if ``hooks``)."""
    ps = prompts(LENGTHS, seed=12)
    (res,) = vllm_logits(model_dir, [ps], max_tokens=MAX_TOKENS, llm_kwargs=LLM_KWARGS)
    seqs = [s.positions_ids for s in res]
    ref16, dec16 = _reference_logits(model_dir, seqs, torch.bfloat16, hooks)
    ref32, dec32 = _reference_logits(model_dir, seqs, torch.float32, hooks)
    ties = [decision_near_ties(a, b, len(ids)) for a, b, ids in zip(dec16, dec32, seqs)] if hooks else None
    return paired_sequences(res, ref16, ref32), ties


@pytest.fixture(scope="module")
def continuous(tmp_path_factory):
    d = make_tiny(tmp_path_factory.mktemp("dsv4bf16") / "continuous", seed=SEED, **CONTINUOUS)
    per_seq, _ = _serve_and_compare(d)
    return rounding_scale(per_seq)


def test_bfloat16_continuous_every_position_within_rounding(continuous, evidence_root):
    rec = EvidenceRecord(model="deepseek_v4", gate="bfloat16_vs_transformers_bf16_continuous")
    rec.command(f"make_tiny(seed={SEED}, {CONTINUOUS}); vllm.LLM(dir, {LLM_KWARGS}) greedy {MAX_TOKENS}, raw logits")
    rec.command("transformers DeepseekV4ForCausalLM from_pretrained(dtype=bfloat16) under torch.autocast('cpu', bfloat16); "
                "and dtype=float32 for E")  # fmt: skip
    ok = check_continuous(rec, continuous, LENGTHS)
    rec.write(evidence_root)
    assert ok, rec.checks


def test_bfloat16_discrete_choices_flip_only_at_near_ties(continuous, tmp_path, evidence_root):
    rec = EvidenceRecord(model="deepseek_v4", gate="bfloat16_vs_transformers_bf16_discrete")
    d = make_tiny(tmp_path / "discrete", seed=SEED)
    rec.command(
        f"make_tiny(seed={SEED}) (top-2 of 8 experts, index_topk 4); vllm.LLM(dir, {LLM_KWARGS}) greedy {MAX_TOKENS}"
    )
    rec.command("transformers bf16 (autocast) and float32 with forward hooks on every TopKRouter and Indexer "
                "scorer: each decision's scores in both")  # fmt: skip
    per_seq, ties = _serve_and_compare(d, _decisions)
    ok = check_discrete(rec, continuous, per_seq, ties, MIN_COMPARED)
    rec.write(evidence_root)
    assert ok, rec.checks
