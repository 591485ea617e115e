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
   chosen and the first rejected score is, relative to those scores, within the relative rounding
   size ``2 E_A / max|logit|`` that the logits show. Nothing is loosened; the record counts them.
"""

from __future__ import annotations

import pytest
import torch
from _dsv4_cases import prompts

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.deepseek_v4.tiny import make_tiny
from ascend_adapters.testing.bf16 import check_continuous, check_discrete, paired_sequences, rounding_scale
from ascend_adapters.testing.parity import vllm_logits

pytestmark = [pytest.mark.vllm, pytest.mark.gate]

LENGTHS = (7, 61, 150)  # window 16; CSA rate 4; HCA rate 16
MAX_TOKENS = 4
SEED = 5
CONTINUOUS = {"num_experts_per_tok": 8, "index_topk": 64}  # 8 experts; 256 / 4 = 64 CSA entries at most
LLM_KWARGS = {"max_model_len": 256, "dtype": "bfloat16"}


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


def _decision_gaps(model, rec):
    """Per position, the relative gap between the last chosen and the first rejected score of every
    routed top-k and every indexer top-k decision (inf where nothing can be rejected)."""
    handles = []
    for name, mod in model.named_modules():
        kind = type(mod).__name__
        if kind == "DeepseekV4TopKRouter":

            def router(m, inp, out, name=name):
                s = m.score_fn(out[0].float()) + m.e_score_correction_bias.float()
                v = s.sort(-1, descending=True).values
                k = m.top_k
                rel = (v[:, k - 1] - v[:, k]) / v[:, k - 1 : k + 1].abs().amax(-1).clamp_min(1e-30)
                rec.append({"layer": name, "kind": "router", "rel_gap": rel})

            handles.append(mod.register_forward_hook(router))
        elif kind == "DeepseekV4Indexer":

            def indexer(m, inp, out, name=name, rate=mod.compress_rate, k=mod.index_topk):
                sc = out[0].float()  # [S, T] before the causal mask
                rel = torch.full((sc.shape[0],), float("inf"))
                for t in range(sc.shape[0]):
                    valid = min((t + 1) // rate, sc.shape[1])  # entries this query may see
                    if valid > k:
                        v = sc[t, :valid].sort(descending=True).values
                        rel[t] = (v[k - 1] - v[k]) / v[k - 1 : k + 1].abs().max().clamp_min(1e-30)
                rec.append({"layer": name, "kind": "indexer", "rel_gap": rel})

            handles.append(mod.scorer.register_forward_hook(indexer))
    return handles


def _serve_and_compare(model_dir, hooks=None):
    ps = prompts(LENGTHS, seed=12)
    (res,) = vllm_logits(model_dir, [ps], max_tokens=MAX_TOKENS, llm_kwargs=LLM_KWARGS)
    seqs = [s.positions_ids for s in res]
    ref16, gaps = _reference_logits(model_dir, seqs, torch.bfloat16, hooks)
    ref32, _ = _reference_logits(model_dir, seqs, torch.float32)
    return paired_sequences(res, ref16, ref32), gaps


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
    rec.command("transformers bf16 (autocast) with forward hooks on every TopKRouter and Indexer scorer: decision gaps")
    per_seq, gaps = _serve_and_compare(d, _decision_gaps)
    ok = check_discrete(rec, continuous, per_seq, [[g["rel_gap"] for g in seq_gaps] for seq_gaps in gaps])
    rec.write(evidence_root)
    assert ok, rec.checks
