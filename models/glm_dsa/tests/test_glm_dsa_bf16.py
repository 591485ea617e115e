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
   gap between the last chosen and the first rejected score is, relative to those scores, within
   the relative rounding size ``2 E_A / max|logit|`` the logits show.
"""

from __future__ import annotations

import pytest
import torch
from _glm_dsa_ref import _index_scores, build, random_prompts

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.testing.bf16 import check_continuous, check_discrete, paired_sequences, rounding_scale
from ascend_adapters.testing.parity import vllm_logits

pytestmark = [pytest.mark.vllm, pytest.mark.gate]

LENGTHS = (5, 23, 50)
MAX_TOKENS = 6
CONTINUOUS = {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "index_topk": 64}
LLM_KWARGS = {"max_model_len": 96, "block_size": 16, "max_num_batched_tokens": 16, "dtype": "bfloat16"}


def _rel_gap(sorted_desc, k):
    return float((sorted_desc[k - 1] - sorted_desc[k]) / sorted_desc[k - 1 : k + 1].abs().max().clamp_min(1e-30))


def _decision_hooks(model, rec):
    """Per position, the smallest relative gap at any group / routed top-k / indexer top-k boundary."""
    handles = []
    for name, mod in model.named_modules():
        kind = type(mod).__name__
        if kind == "GlmMoeDsaTopkRouter":

            def router(m, inp, out, name=name):
                s = out[0].float().sigmoid() + m.e_score_correction_bias.float()
                gaps = torch.full((s.shape[0],), float("inf"))
                per_group = s.view(s.shape[0], m.num_group, -1)
                gs = per_group.topk(2, dim=-1).values.sum(-1)
                for t in range(s.shape[0]):
                    g = gs[t].sort(descending=True).values
                    chosen = s[t]
                    if m.topk_group < m.num_group:
                        gaps[t] = min(gaps[t], _rel_gap(g, m.topk_group))
                        keep = gs[t].topk(m.topk_group).indices
                        chosen = per_group[t, keep].flatten()
                    if m.top_k < chosen.numel():
                        gaps[t] = min(gaps[t], _rel_gap(chosen.sort(descending=True).values, m.top_k))
                rec.append(gaps)

            handles.append(mod.register_forward_hook(router))
        elif kind == "GlmMoeDsaIndexer":

            def indexer(m, args, kwargs, out):
                with torch.no_grad():
                    sc = _index_scores(m, *args, **kwargs).float()  # [S, T] before the causal mask
                gaps = torch.full((sc.shape[0],), float("inf"))
                for t in range(sc.shape[0]):
                    if t + 1 > m.index_topk:
                        gaps[t] = _rel_gap(sc[t, : t + 1].sort(descending=True).values, m.index_topk)
                rec.append(gaps)

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
    ps = random_prompts(LENGTHS, seed=9)
    (res,) = vllm_logits(ckpt, [ps], max_tokens=MAX_TOKENS, llm_kwargs=LLM_KWARGS)
    seqs = [s.positions_ids for s in res]
    r16, gaps = _reference(ckpt, seqs, torch.bfloat16, hooks)
    r32, _ = _reference(ckpt, seqs, torch.float32)
    return paired_sequences(res, r16, r32), gaps


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
    rec.command("transformers bf16 with forward hooks on every TopkRouter and Indexer: decision gaps per position")
    per_seq, gaps = _serve_and_compare(ckpt, _decision_hooks)
    ok = check_discrete(rec, continuous, per_seq, gaps)
    rec.write(evidence_root)
    assert ok, rec.checks
