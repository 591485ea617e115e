"""DeepSeek-V4's attention state in vLLM's paged KV cache, at length, against transformers.

One engine (float32, the tiny checkpoint: window 16, CSA rate 4 with indexer top-4, HCA rate 16),
prefix caching on, chunked prefill with a 256-token budget (a prompt that shares a step with other
requests' tokens is split inside a compression window),
and a KV cache of ``_kv_bytes`` (vLLM's start-up check for one max_model_len request, with a quarter more).
Batches, in order:

1. a 640-token prompt alone: 40 HCA entries, 160 CSA entries, several blocks of every cache;
2. its first 400 tokens and a new tail: 384 served from vLLM's prefix cache (hits every 128 tokens,
   ``memory.hit_tokens``; its counters show them);
3. another long prompt batched with three short ones;
4. four prompts of max_model_len - 8 tokens at once, in a cache that holds about one: they wait for
   each other's blocks;
5. fourteen 16-token prompts generating 300 tokens each: all are admitted in the first step (14 x 16 tokens
   within the budget and the cache) and decode together until their caches outgrow it
   (``memory.request_cache_bytes`` computes both, the record's check names the block counts): vLLM preempts
   requests mid-generation and recomputes them
   (``vllm:num_preemptions``).

Every generated step's logits are within 1e-3 of transformers run on the same tokens and the greedy
tokens are identical.
"""

from __future__ import annotations

import pytest
from _dsv4_cases import hf_model, prompts, reference_fn

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.deepseek_v4.memory import cache_groups, hit_tokens, request_cache_bytes, reserved_blocks
from ascend_adapters.deepseek_v4.tiny import make_tiny, tiny_config
from ascend_adapters.testing.engine_worker import engine_run

TOL = 1e-3
MAX_TOKENS = 8
MAX_MODEL_LEN = 1024
LONG, SHARED, SHORT = 640, 400, (5, 17, 33)
BUDGET = 256
FULL = MAX_MODEL_LEN - MAX_TOKENS  # batch 4: prompts that fill max_model_len
PREEMPT_SEQS, PREEMPT_PROMPT, PREEMPT_TOKENS = 14, 16, 300  # batch 5


def _kv_bytes(config) -> int:
    """What vLLM's start-up check asks for one max_model_len request (each group's reservation: every
    block of a full cache; a sliding cache's window plus a whole scheduler step and one block; a block id
    spans every group's pages), with a quarter more: batch 4's requests still do not all fit at once."""
    groups, slab = cache_groups(config, config.layer_types, 4)  # float32
    return int(1.25 * slab * sum(reserved_blocks(g.geometry, MAX_MODEL_LEN, BUDGET) for g in groups))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = make_tiny(tmp_path_factory.mktemp("dsv4paged") / "tiny")
    cfg = tiny_config()
    first, second = prompts([LONG, LONG], seed=31)
    tail = prompts([LONG - SHARED], seed=32)[0]
    runs = [
        [first],
        [first[:SHARED] + tail],
        [second, *prompts(SHORT, seed=33)],
        prompts([FULL] * 4, seed=34),
        prompts([PREEMPT_PROMPT] * PREEMPT_SEQS, seed=35),
    ]
    llm_kwargs = {
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_memory_bytes": _kv_bytes(cfg),
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": BUDGET,
        "max_num_seqs": PREEMPT_SEQS,
        # eager: the compiled path is test_deepseek_v4_compiled's
        "enforce_eager": True,
    }
    batches = engine_run(model_dir, runs, [MAX_TOKENS] * 4 + [PREEMPT_TOKENS], llm_kwargs)
    return model_dir, cfg, llm_kwargs, batches


@pytest.mark.vllm
@pytest.mark.gate
def test_paged_state_at_length_with_prefix_cache(served, evidence_root):
    model_dir, cfg, llm_kwargs, batches = served
    ref = reference_fn(hf_model(model_dir))
    rec = EvidenceRecord(model="deepseek_v4", gate="paged_long_context")
    rec.command(
        f"vllm.LLM({model_dir.name}, {llm_kwargs}) greedy {MAX_TOKENS} tokens ({PREEMPT_TOKENS} in batch 5), "
        "raw logits, 5 batches on one "
        "engine; reference transformers DeepseekV4ForCausalLM float32 on the same tokens"
    )
    worst, identical, rows = 0.0, True, []
    for b, batch in enumerate(batches):
        for row in batch["rows"]:
            prompt, gen = row["prompt_ids"], row["gen_ids"]
            want = ref(prompt + gen[:-1])[len(prompt) - 1 :]
            diff = float((row["logits"] - want).abs().max())
            same = want.argmax(-1).tolist() == gen
            worst, identical = max(worst, diff), identical and same
            rows.append(
                {"batch": b, "prompt_len": len(prompt), "cached": row["num_cached_tokens"], "max_abs_diff": diff}
            )
    rec.metric("rows", rows)
    rec.metric("max_abs_logit_diff", worst)
    rec.metric("counters", [batch["counters"] for batch in batches])
    unit = hit_tokens(cfg)
    expected_hit = SHARED // unit * unit
    rec.metric("prefix_hit_unit_tokens", unit)
    ok = [
        rec.check("logits within 1e-3 at every generated step", worst < TOL, f"{worst:.3e}"),
        rec.check("greedy tokens identical", identical),
        rec.check(
            f"prefix-cache hit: the shared {SHARED} tokens give {expected_hit} cached (whole {unit}-token units)",
            expected_hit > 0 and batches[1]["rows"][0]["num_cached_tokens"] == expected_hit and batches[1]["hits"] > 0,
            f"cached {batches[1]['rows'][0]['num_cached_tokens']}, hits {batches[1]['hits']}",
        ),
    ]
    # batch 5 preempts only if its requests fit the cache at their prompts and outgrow it while decoding
    slab = cache_groups(cfg, cfg.layer_types, 4)[1]
    pool_pages = _kv_bytes(cfg) // slab
    admitted = request_cache_bytes(cfg, PREEMPT_PROMPT + 1, 4) // slab
    # the sliding caches' blocks come and go as their windows move: the peak over the decode, all in step
    peak = max(
        request_cache_bytes(cfg, n, 4) // slab for n in range(PREEMPT_PROMPT + 1, PREEMPT_PROMPT + PREEMPT_TOKENS)
    )
    preempted = batches[4]["counters"].get("vllm:num_preemptions", 0)
    ok += [
        rec.check(
            f"batch 5 admitted at once and outgrows the cache: {PREEMPT_SEQS} x {admitted} <= {pool_pages} < "
            f"{PREEMPT_SEQS} x {peak} blocks (at the peak of its decode)",
            PREEMPT_SEQS * admitted <= pool_pages < PREEMPT_SEQS * peak,
        ),
        rec.check(
            "batch 5 preempted requests mid-generation (vLLM's preemption counter)", preempted > 0, f"{preempted}"
        ),
    ]
    rec.write(evidence_root)
    assert all(ok), rec.checks
