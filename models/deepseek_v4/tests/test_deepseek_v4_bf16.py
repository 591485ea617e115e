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
B. ``discrete``: the shipped tiny config (top-2 of 8 experts, index_topk 4), every position compared
   within ``E_A + E_S`` (``E_S``: the served model's own distance to the float32 reference in A;
   the two bf16 sides are each that close to it). A near-tie is a routing or indexer decision whose gap between the last chosen and
   the first rejected score is within 4 ``E_d``, ``E_d`` the reference's own bf16-vs-fp32 difference of
   that decision's scores (``testing.bf16.decision_near_ties``): there the served model may choose the
   other way, and every later position then differs by more than rounding. Where a position deviates,
   the reference is made to take a near-tie decision at or before it the other way (forward hooks
   swap a chosen candidate for a rejected one within 4 ``E_d`` of it) and the comparison continues with it
   (``testing.bf16.follow_near_ties``); a deviation no near-tie flip explains fails. The reference
   runs on the served token ids, so a greedy divergence is teacher-forced by construction.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from _dsv4_cases import prompts

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.deepseek_v4.tiny import make_tiny
from ascend_adapters.testing.bf16 import (
    check_continuous,
    check_discrete,
    following_references,
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
# B compares every served position (prompt and generated steps but the last) of the three sequences
MIN_COMPARED = sum(n + MAX_TOKENS - 1 for n in LENGTHS)


def _load(model_dir, dtype):
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()


def _forward(model, ids, forced=(), hooks=None):
    """Logits ``[n, V]`` of one sequence, and the decisions ``hooks`` recorded (``forced`` taken the other way)."""
    rec = []
    handles = hooks(model, rec, forced) if hooks else []
    try:
        with (
            torch.no_grad(),
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=model.lm_head.weight.dtype == torch.bfloat16),
        ):
            logits = model(torch.tensor([ids])).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    return logits, rec


def _decisions(model, rec, forced=()):
    """Record every routed top-k and every indexer top-k decision of a forward (its scores per position,
    which candidates each position may choose from, and k: ``testing.bf16.decision_near_ties``), in call
    order; for each ``(d, t, i, j)`` in ``forced``, decision ``d`` at position ``t`` rejects its candidate
    of rank i and chooses the one of rank j instead (ranks in the order of its scores)."""
    swaps_of = {}
    for d, t, i, j in forced:
        swaps_of.setdefault(d, {}).setdefault(t, []).append((i, j))
    handles = []
    for mod in model.modules():
        kind = type(mod).__name__
        if kind == "DeepseekV4TopKRouter":

            def router(m, inp, out):
                logits, weights, indices = out
                scores = m.score_fn(logits)
                biased = scores + m.e_score_correction_bias  # what the router's topk compares
                swaps = swaps_of.get(len(rec), ())
                rec.append({"scores": biased.float(), "valid": torch.ones_like(biased, dtype=torch.bool), "k": m.top_k})
                if not swaps:
                    return None
                weights, indices = weights.clone(), indices.clone()
                for t, ranks in swaps.items():
                    order = biased[t].float().argsort(descending=True)
                    chosen = order[: m.top_k].clone()
                    for i, j in ranks:
                        chosen[i] = order[j]
                    indices[t] = chosen
                    w = scores[t, chosen]
                    weights[t] = w / (w.sum() + 1e-20) * m.routed_scaling_factor
                return logits, weights, indices

            handles.append(mod.register_forward_hook(router))
        elif kind == "DeepseekV4Indexer":

            def indexer(m, inp, out, rate=mod.compress_rate, k=mod.index_topk):
                sc = out[0]  # [S, T] before the causal mask; the indexer's topk only selects
                seen = ((torch.arange(sc.shape[0]) + 1) // rate).clamp(max=sc.shape[1])  # entries each query sees
                valid = torch.arange(sc.shape[1])[None, :] < seen[:, None]
                swaps = swaps_of.get(len(rec), ())
                rec.append({"scores": sc.float(), "valid": valid, "k": k})
                if not swaps:
                    return None
                out = out.clone()
                for t, ranks in swaps.items():
                    order = sc[t].float().masked_fill(~valid[t], float("-inf")).argsort(descending=True)
                    for i, j in ranks:
                        a, b = order[i], order[j]
                        out[0, t, a], out[0, t, b] = sc[t, b], sc[t, a]
                return out

            handles.append(mod.scorer.register_forward_hook(indexer))
    return handles


def _serve(model_dir):
    ps = prompts(LENGTHS, seed=12)
    (res,) = vllm_logits(model_dir, [ps], max_tokens=MAX_TOKENS, llm_kwargs=LLM_KWARGS)
    return res


def _paired(res, m16, m32):
    seqs = [s.positions_ids for s in res]
    return paired_sequences(res, [_forward(m16, ids)[0] for ids in seqs], [_forward(m32, ids)[0] for ids in seqs])


@pytest.fixture(scope="module")
def continuous(tmp_path_factory):
    d = make_tiny(tmp_path_factory.mktemp("dsv4bf16") / "continuous", seed=SEED, **CONTINUOUS)
    return rounding_scale(_paired(_serve(d), _load(d, torch.bfloat16), _load(d, torch.float32)))


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
    res = _serve(d)
    m16, m32 = _load(d, torch.bfloat16), _load(d, torch.float32)
    per_seq, references = following_references(res, partial(_forward, hooks=_decisions), m16, m32)
    ok = check_discrete(rec, continuous, per_seq, references, MIN_COMPARED)
    rec.write(evidence_root)
    assert ok, rec.checks
