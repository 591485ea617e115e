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
B. ``discrete``: the shipped tiny config (2 groups, top-2 of 8, index_topk 8; prompts past 8):
   positions within ``2 E_A`` need nothing more; in every sequence the first position beyond it
   must come at or after a near-tie in the reference: a group, routing or indexer decision whose
   gap between the last chosen and the first rejected score is within 4 ``E_d``, ``E_d`` the
   reference's own bf16-vs-fp32 difference of that decision's scores
   (``testing.bf16.decision_near_ties``). At least ``MIN_COMPARED`` positions must come before their
   sequence's first near-tie.
"""

from __future__ import annotations

import pytest
import torch
from _glm_dsa_ref import _index_scores, build, random_prompts

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.testing.bf16 import (
    check_continuous,
    check_discrete,
    decision_near_ties,
    paired_sequences,
    rounding_scale,
)
from ascend_adapters.testing.parity import vllm_logits

pytestmark = [pytest.mark.vllm, pytest.mark.gate]

LENGTHS = (5, 23, 50)
MAX_TOKENS = 6
CONTINUOUS = {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "index_topk": 64}
LLM_KWARGS = {"max_model_len": 96, "block_size": 16, "max_num_batched_tokens": 16, "dtype": "bfloat16"}
# B compares the positions before each sequence's first near-tie: at least this many over the three
# sequences (the 5-token prompt alone has 10 positions), or the record compared too little to say anything.
MIN_COMPARED = 10


def _decisions(model, rec):
    """Every group, routed top-k and indexer top-k decision of a forward: its scores per position, which
    candidates each position may choose from, and k (``testing.bf16.decision_near_ties``)."""
    handles = []
    for mod in model.modules():
        kind = type(mod).__name__
        if kind == "GlmMoeDsaTopkRouter":

            def router(m, inp, out):
                s = out[0].float().sigmoid() + m.e_score_correction_bias.float()
                per_group = s.view(s.shape[0], m.num_group, -1)
                group_scores = per_group.topk(2, dim=-1).values.sum(-1)
                everyone = torch.ones_like(s, dtype=torch.bool)
                if m.topk_group < m.num_group:
                    rec.append({"scores": group_scores, "valid": torch.ones_like(group_scores, dtype=torch.bool),
                                "k": m.topk_group})  # fmt: skip
                    keep = group_scores.topk(m.topk_group, dim=-1).indices
                    in_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
                    everyone = in_kept.repeat_interleave(per_group.shape[-1], dim=1)
                rec.append({"scores": s, "valid": everyone, "k": m.top_k})

            handles.append(mod.register_forward_hook(router))
        elif kind == "GlmMoeDsaIndexer":

            def indexer(m, args, kwargs, out):
                with torch.no_grad():
                    sc = _index_scores(m, *args, **kwargs).float()  # [S, T] before the causal mask
                causal = torch.arange(sc.shape[1])[None, :] <= torch.arange(sc.shape[0])[:, None]
                rec.append({"scores": sc, "valid": causal, "k": m.index_topk})

            handles.append(mod.register_forward_hook(indexer, with_kwargs=True))
    return handles


def _reference(ckpt, seqs, dtype, hooks=None):
    from transformers import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(str(ckpt), dtype=dtype, attn_implementation="eager").eval()
    out, gaps = [], []
    for ids in seqs:
        rec = []
        handles = hooks(model, rec) if hooks else []
        with torch.no_grad():
            out.append(model(torch.tensor([ids])).logits[0].float())
        for h in handles:
            h.remove()
        gaps.append(rec)
    return out, gaps


def _serve_and_compare(ckpt, hooks=None):
    """Paired sequences, and per sequence the near-tie positions of the hooked decisions (if ``hooks``)."""
    ps = random_prompts(LENGTHS, seed=9)
    (res,) = vllm_logits(ckpt, [ps], max_tokens=MAX_TOKENS, llm_kwargs=LLM_KWARGS)
    seqs = [s.positions_ids for s in res]
    r16, dec16 = _reference(ckpt, seqs, torch.bfloat16, hooks)
    r32, dec32 = _reference(ckpt, seqs, torch.float32, hooks)
    ties = [decision_near_ties(a, b, len(ids)) for a, b, ids in zip(dec16, dec32, seqs)] if hooks else None
    return paired_sequences(res, r16, r32), ties


@pytest.fixture(scope="module")
def continuous(tmp_path_factory):
    ckpt = build(tmp_path_factory.mktemp("glmbf16"), "continuous", **CONTINUOUS)
    per_seq, _ = _serve_and_compare(ckpt)
    return rounding_scale(per_seq)


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
    per_seq, ties = _serve_and_compare(ckpt, _decisions)
    ok = check_discrete(rec, continuous, per_seq, ties, MIN_COMPARED)
    rec.write(evidence_root)
    assert ok, rec.checks
