"""Pipeline parallelism on CPU (two stages, one worker process and one CPU each), against transformers'
own GlmMoeDsaForCausalLM and against the same engine at PP=1.

The tiny model has three layers, indexer types full, full, shared; the stages hold layers 0-1 and 2
(VLLM_PP_LAYER_PARTITION=2,1), so the second stage starts with a 'shared' layer whose top-k selection
comes from layer 1 on the first stage: it travels between the stages with the hidden states and the
residual (a 'shared' layer without a selection raises, so a run that completes used the one sent). The
first stage holds the embeddings, the last the final norm and lm_head; each loads only its own tensors.
Served on the sparse path (index_topk 8, prompts far longer), each prompt alone, then all batched, with
chunked prefill (32 tokens per step), in one engine start.
"""

from __future__ import annotations

import pytest
from _glm_dsa_ref import Reference, build, random_prompts

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.glm_dsa.tiny import TINY_CONFIG
from ascend_adapters.testing.parity import compare, two_rank_cpu_bind, vllm_logits

# float32: a pipeline split moves no arithmetic (each layer runs whole on one stage; the stages hand over
# hidden states, residual and selection unchanged), so the single-process parity bound applies unchanged
# (test_glm_dsa_parity.TOL, as test_glm_dsa_tp.TOL).
TOL = 1e-3
PARTITION = "2,1"


@pytest.mark.vllm
@pytest.mark.gate
def test_pp2_matches_transformers_alone_batched_chunked(tmp_path, evidence_root):
    assert TINY_CONFIG["indexer_types"] == ["full", "full", "shared"]  # the split below crosses IndexShare
    rec = EvidenceRecord(model="glm_dsa", gate="parity_pp2")
    ckpt = build(tmp_path, "tiny-sparse", index_topk=8)
    prompts = random_prompts([5, 30, 47], seed=21)
    runs = [[p] for p in prompts] + [prompts]
    kwargs = {
        "max_model_len": 128,
        "max_num_batched_tokens": 32,
        "max_num_seqs": 4,
        "block_size": 16,
        "pipeline_parallel_size": 2,
        "distributed_executor_backend": "mp",
    }
    env = {**two_rank_cpu_bind("pipeline parallelism 2"), "VLLM_PP_LAYER_PARTITION": PARTITION}
    served = vllm_logits(ckpt, runs, max_tokens=8, llm_kwargs=kwargs, env=env)
    rec.command(
        f"vllm.LLM(<tiny, index_topk 8>, dtype=float32, enforce_eager, {kwargs}), "
        f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}, VLLM_PP_LAYER_PARTITION={PARTITION}: "
        "each prompt alone, then the three batched, one engine"
    )
    ref = Reference(ckpt)
    alone = compare([batch[0] for batch in served[:-1]], ref)
    batched = compare(served[-1], ref)
    same = all(
        a[0].gen_ids == b.gen_ids and float((a[0].logits - b.logits).abs().max()) <= TOL
        for a, b in zip(served[:-1], served[-1])
    )
    rec.metric("alone_vs_transformers_max_abs_diff", alone.max_abs_diff)
    rec.metric("batched_vs_transformers_max_abs_diff", batched.max_abs_diff)
    rec.check(
        f"PP=2, each prompt alone: logits within {TOL} of transformers", alone.max_abs_diff <= TOL, alone.as_dict()
    )
    rec.check(
        f"PP=2, batched with chunked prefill: logits within {TOL} of transformers",
        batched.max_abs_diff <= TOL,
        batched.as_dict(),
    )
    rec.check("greedy tokens identical to transformers", alone.tokens_identical and batched.tokens_identical)
    rec.check(f"batched run equals the runs alone (tokens, logits within {TOL})", same)
    rec.notes.append(
        "sparse path (max_model_len 128 > index_topk 8); stages hold layers 0-1 and 2, layer 2 is 'shared' "
        "and reads layer 1's top-k from the first stage; prompts 5, 30, 47 tokens, chunked prefill 32 tokens"
    )
    rec.write(evidence_root)
    assert alone.max_abs_diff <= TOL and batched.max_abs_diff <= TOL
    assert alone.tokens_identical and batched.tokens_identical and same
