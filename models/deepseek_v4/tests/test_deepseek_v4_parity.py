"""vLLM-served DeepSeek-V4 vs transformers' DeepseekV4ForCausalLM (float32, tiny random checkpoint).

Logits at every prompt position and generated step within 1e-3, greedy tokens identical, for
prompts inside the sliding window (16) and up to ~10x beyond it (CSA with indexer top-k and
HCA carry the long range), batched in one engine call with chunked prefill (16-token chunks,
so prompts are split mid-window and mid-compression-block).
"""

from __future__ import annotations

import pytest
from _dsv4_cases import hf_model, prompts, reference_fn

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.deepseek_v4.tiny import make_tiny
from ascend_adapters.testing.parity import compare, vllm_logits

TOL = 1e-3
LENGTHS = (7, 16, 61, 150)  # window is 16; CSA rate 4 (top-4 of up to 37 entries), HCA rate 16
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = make_tiny(tmp_path_factory.mktemp("dsv4p") / "tiny")
    return d, reference_fn(hf_model(d))


def _run(tiny, evidence_root, gate, llm_kwargs):
    model_dir, ref = tiny
    ps = prompts(LENGTHS, seed=11)
    rec = EvidenceRecord(model="deepseek_v4", gate=gate)
    rec.command(
        f"vllm.LLM({model_dir}, float32, {llm_kwargs}) greedy {MAX_TOKENS} tokens, raw logits; "
        "reference transformers DeepseekV4ForCausalLM float32"
    )
    res = vllm_logits(model_dir, [ps], max_tokens=MAX_TOKENS, llm_kwargs={"max_model_len": 256, **llm_kwargs})
    rep = compare(res[0], ref)
    rec.metric("prompt_lengths", list(LENGTHS))
    rec.metric("sliding_window", 16)
    rec.metric("max_abs_logit_diff", rep.max_abs_diff)
    rec.metric("per_sequence", rep.per_sequence)
    ok_l = rec.check("logits within 1e-3 at every position", rep.max_abs_diff < TOL, f"{rep.max_abs_diff:.3e}")
    ok_t = rec.check("greedy tokens identical", rep.tokens_identical, rep.first_divergence)
    rec.notes.append("bfloat16: test_deepseek_v4_bf16.py (against transformers in bfloat16)")
    rec.write(evidence_root)
    assert ok_l, rep.as_dict()
    assert ok_t, rep.as_dict()


@pytest.mark.vllm
@pytest.mark.gate
def test_parity_batched_chunked_prefill_beyond_window(tiny, evidence_root):
    """All four prompts in one engine call with a 16-token scheduler budget: prompts are split across
    steps and share steps with other requests' decodes (whole-prompt prefill is covered by the serve
    tests)."""
    _run(
        tiny,
        evidence_root,
        "parity_batched_chunked_prefill",
        {"max_num_batched_tokens": 16, "enable_chunked_prefill": True, "max_num_seqs": 4},
    )
