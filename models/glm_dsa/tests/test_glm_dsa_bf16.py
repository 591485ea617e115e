"""Gate: GLM-DSA served by vLLM in bfloat16 (portable sparse path) against transformers'
GlmMoeDsaForCausalLM in bfloat16 (eager), same tiny checkpoint, same prompts, every prompt position
and generated step, the reference run on exactly the token ids vLLM saw.

Bound, from bfloat16 rounding (u = 2^-8): both sides compute the same function from the same
bfloat16 weights and differ only in where and in which order they round. How far rounding moves
this model's logits is measured on the independent side: ``E`` = max |transformers bf16 -
transformers fp32| over the compared positions; a second bfloat16 implementation that rounds
comparably is within ``E`` of the float32 result too, so the two bfloat16 runs differ by at most
``2 E`` (triangle inequality). A model error moves logits by O(|logit|).

Discrete choices (expert group, routed top-k, the indexer's top-k keys) flip when rounding reorders
two nearly equal scores, and a flip moves logits by far more than rounding. So:

A. ``continuous``: the same weights with every choice made total (one expert group, all 8 experts
   routed, index_topk 64 > every position compared, served on the sparse path since
   max_model_len 96 > 64): nothing can flip; every position within 2 E.
B. ``discrete``: the shipped tiny config (2 groups, top-2 of 8, index_topk 8; prompts past 8), every
   position compared within ``E_A + E_S`` (``E_S``: the served model's own distance to the float32
   reference in A; the two bf16 sides are each that close to it). A near-tie is a group, routing or indexer decision whose gap
   between the last chosen and the first rejected score is within 4 ``E_d``, ``E_d`` the reference's
   own bf16-vs-fp32 difference of that decision's scores (``testing.bf16.decision_near_ties``): there
   the served model may choose the other way, and every later position then differs by more than
   rounding. Where a position deviates, the reference is made to take a near-tie decision at or
   before it the other way (forward hooks swap a chosen candidate for a rejected one within 4 ``E_d``) and
   the comparison continues with it (``testing.bf16.follow_near_ties``); a deviation no near-tie flip
   explains fails. The reference runs on the served token ids, so a greedy divergence is
   teacher-forced by construction.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from _glm_dsa_ref import _index_scores, build, random_prompts

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.testing.bf16 import (
    check_continuous,
    check_discrete,
    following_references,
    paired_sequences,
    rounding_scale,
)
from ascend_adapters.testing.parity import vllm_logits

pytestmark = [pytest.mark.vllm, pytest.mark.gate]

LENGTHS = (5, 23, 50)
MAX_TOKENS = 6
CONTINUOUS = {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "index_topk": 64}
LLM_KWARGS = {"max_model_len": 96, "block_size": 16, "max_num_batched_tokens": 16, "dtype": "bfloat16"}
# B compares every served position (prompt and generated steps but the last) of the three sequences
MIN_COMPARED = sum(n + MAX_TOKENS - 1 for n in LENGTHS)


def _decisions(model, rec, forced=()):
    """Record every group, routed top-k and indexer top-k decision of a forward (its scores per position,
    which candidates each position may choose from, and k: ``testing.bf16.decision_near_ties``), in call
    order; for each ``(d, t, i, j)`` in ``forced``, decision ``d`` at position ``t`` rejects its candidate
    of rank i and chooses the one of rank j instead (ranks in the order of its scores; after a group swap
    the experts are chosen again among the new groups' experts)."""
    swaps_of = {}
    for d, t, i, j in forced:
        swaps_of.setdefault(d, {}).setdefault(t, []).append((i, j))

    def swapped_top_k(scores, valid, k, ranks):
        """The top k of ``scores`` over ``valid`` with rank i replaced by rank j for each (i, j) in ``ranks``."""
        order = scores.masked_fill(~valid, float("-inf")).argsort(descending=True)
        chosen = order[:k].clone()
        for i, j in ranks:
            chosen[i] = order[j]
        return chosen

    handles = []
    for mod in model.modules():
        kind = type(mod).__name__
        if kind == "GlmMoeDsaTopkRouter":

            def router(m, inp, out):
                logits, weights, indices = out
                scores = logits.sigmoid()
                choice = scores + m.e_score_correction_bias  # what the router's topk compares (float32)
                per_group = choice.view(choice.shape[0], m.num_group, -1)
                group_scores = per_group.topk(2, dim=-1).values.sum(-1)
                group_rows = expert_rows = {}
                kept = group_scores.topk(m.topk_group, dim=-1).indices
                if m.topk_group < m.num_group:
                    group_rows = swaps_of.get(len(rec), {})
                    rec.append({"scores": group_scores, "valid": torch.ones_like(group_scores, dtype=torch.bool),
                                "k": m.topk_group})  # fmt: skip
                    kept = kept.clone()
                    for t, ranks in group_rows.items():
                        every_group = torch.ones_like(group_scores[t], dtype=torch.bool)
                        kept[t] = swapped_top_k(group_scores[t], every_group, m.topk_group, ranks)
                in_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
                allowed = in_kept.repeat_interleave(per_group.shape[-1], dim=1)
                expert_rows = swaps_of.get(len(rec), {})
                rec.append({"scores": choice, "valid": allowed, "k": m.top_k})
                rows = set(group_rows) | set(expert_rows)
                if not rows:
                    return None
                weights, indices = weights.clone(), indices.clone()
                for t in rows:
                    if t in expert_rows:
                        indices[t] = swapped_top_k(choice[t], allowed[t], m.top_k, expert_rows[t])
                    else:
                        indices[t] = choice[t].masked_fill(~allowed[t], float("-inf")).topk(m.top_k).indices
                    w = scores[t, indices[t]]
                    if m.norm_topk_prob:
                        w = w / (w.sum() + 1e-20)
                    weights[t] = w * m.routed_scaling_factor
                return logits, weights, indices

            handles.append(mod.register_forward_hook(router))
        elif kind == "GlmMoeDsaIndexer":

            def indexer(m, args, kwargs, out):
                with torch.no_grad():
                    sc = _index_scores(m, *args, **kwargs).float()  # [S, T] before the causal mask
                causal = torch.arange(sc.shape[1])[None, :] <= torch.arange(sc.shape[0])[:, None]
                rows = swaps_of.get(len(rec), {})
                rec.append({"scores": sc, "valid": causal, "k": m.index_topk})
                if not rows:
                    return None
                out = out.clone()
                for t, ranks in rows.items():
                    out[0, t] = swapped_top_k(sc[t], causal[t], m.index_topk, ranks).to(out.dtype)
                return out

            handles.append(mod.register_forward_hook(indexer, with_kwargs=True))
    return handles


def _load(ckpt, dtype):
    from transformers import GlmMoeDsaForCausalLM

    return GlmMoeDsaForCausalLM.from_pretrained(str(ckpt), dtype=dtype, attn_implementation="eager").eval()


def _forward(model, ids, forced=(), hooks=None):
    """Logits ``[n, V]`` of one sequence, and the decisions ``hooks`` recorded (``forced`` taken the other way)."""
    rec = []
    handles = hooks(model, rec, forced) if hooks else []
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    return logits, rec


def _serve(ckpt):
    (res,) = vllm_logits(ckpt, [random_prompts(LENGTHS, seed=9)], max_tokens=MAX_TOKENS, llm_kwargs=LLM_KWARGS)
    return res


def _paired(res, m16, m32):
    seqs = [s.positions_ids for s in res]
    return paired_sequences(res, [_forward(m16, ids)[0] for ids in seqs], [_forward(m32, ids)[0] for ids in seqs])


@pytest.fixture(scope="module")
def continuous(tmp_path_factory):
    ckpt = build(tmp_path_factory.mktemp("glmbf16"), "continuous", **CONTINUOUS)
    return rounding_scale(_paired(_serve(ckpt), _load(ckpt, torch.bfloat16), _load(ckpt, torch.float32)))


def test_bfloat16_continuous_every_position_within_rounding(continuous, evidence_root):
    rec = EvidenceRecord(model="glm_dsa", gate="bfloat16_vs_transformers_bf16_continuous")
    rec.command(f"make_tiny({CONTINUOUS}) + released extras; vllm.LLM(dir, {LLM_KWARGS}) greedy {MAX_TOKENS}")
    rec.command("transformers GlmMoeDsaForCausalLM(dtype=bfloat16, eager) on the served ids; dtype=float32 for E")
    ok = check_continuous(rec, continuous, LENGTHS)
    rec.write(evidence_root)
    assert ok, rec.checks


def test_bfloat16_discrete_choices_flip_only_at_near_ties(continuous, tmp_path, evidence_root):
    rec = EvidenceRecord(model="glm_dsa", gate="bfloat16_vs_transformers_bf16_discrete")
    ckpt = build(tmp_path, "discrete")
    rec.command(f"make_tiny() (2 groups, top-2 of 8, index_topk 8); vllm.LLM(dir, {LLM_KWARGS}) greedy {MAX_TOKENS}")
    rec.command("transformers bf16 and float32 with forward hooks on every TopkRouter and Indexer: each decision's "
                "scores in both")  # fmt: skip
    res = _serve(ckpt)
    m16, m32 = _load(ckpt, torch.bfloat16), _load(ckpt, torch.float32)
    per_seq, references = following_references(res, partial(_forward, hooks=_decisions), m16, m32)
    ok = check_discrete(rec, continuous, per_seq, references, MIN_COMPARED)
    rec.write(evidence_root)
    assert ok, rec.checks
