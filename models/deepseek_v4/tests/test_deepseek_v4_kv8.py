"""Gate: DeepSeek-V4 with an 8-bit ``--kv-cache-dtype`` (the sliding window, the compressed entries and the indexer
keys 8-bit: ``memory.EIGHT_BIT_KINDS``, ``common.kernels.kv8``) against transformers' DeepseekV4ForCausalLM
whose cache stores the same rows through the documented quantisation (``_dsv4_cases.kv8_reference_fn``: the
OCP E4M3 rounding for ``fp8``, npu_dynamic_quant's int8 formula for ``int8_per_token_head``, written out in
``testing.kv8_reference``, no code shared with the adapter).

Bound: ``testing.kv8_reference`` (its module doc derives it from each format's step).

Served (eager, float32, prefix caching on): the tiny (CSA rate 4 with the indexer, HCA rate 16, window 16),
four prompts of 5..300 tokens batched under chunked prefill (64 tokens a step), the longest alone, then a
prompt sharing the longest's first 256 tokens (two 128-token hits: restored from the 8-bit blocks), in each
format. Then the tiny with an MTP layer at TP=2 with 2 MTP drafts a step (fp8): the target's logits against the
same reference.
"""

from __future__ import annotations

import pytest
from _dsv4_cases import hf_model, kv8_reference_fn, prompts, reference_fn

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.deepseek_v4.memory import hit_tokens
from ascend_adapters.deepseek_v4.tiny import make_tiny, tiny_config
from ascend_adapters.testing.engine_worker import engine_run
from ascend_adapters.testing.kv8_reference import PARITY_GATES, judge, served_on_the_npu_path
from ascend_adapters.testing.parity import two_rank_cpu_bind

KV8 = {
    "dtype": "float32",
    "enforce_eager": True,
    "kv_cache_dtype": "fp8",
    "max_model_len": 1024,
    "kv_cache_memory_bytes": 64 << 20,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 64,
}
LENGTHS = (5, 40, 150, 300)
SHARED = 256  # tokens of the longest prompt a later prompt repeats: two whole 128-token hits
MAX_TOKENS = 10


def _judge(rec, label, model_dir, batches, shared: int | None = None, cache_dtype: str = "fp8") -> bool:
    model = hf_model(model_dir)
    return judge(rec, label, batches, kv8_reference_fn(model, cache_dtype), reference_fn(model), shared)


@pytest.mark.vllm
@pytest.mark.gate
@pytest.mark.parametrize("cache_dtype", ["fp8", "int8_per_token_head"])
def test_kv8_batched_chunked_prefix_hit(tmp_path_factory, evidence_root, cache_dtype):
    assert hit_tokens(tiny_config()) == 128 and SHARED % 128 == 0
    model_dir = make_tiny(tmp_path_factory.mktemp("dsv4_kv8") / "tiny", seed=5)
    rec = EvidenceRecord(model="deepseek_v4", gate=PARITY_GATES[cache_dtype])
    ps = prompts(LENGTHS, seed=61)
    shared = ps[-1][:SHARED] + prompts((30,), seed=62)[0]
    kwargs = {**KV8, "kv_cache_dtype": cache_dtype, "enable_prefix_caching": True}
    batches = engine_run(model_dir, [ps, [ps[-1]], [shared]], MAX_TOKENS, kwargs)
    rec.command(
        f"vllm.LLM(make_tiny(OUT, seed=5), {kwargs}) greedy {MAX_TOKENS} tokens, raw logits: prompts of {LENGTHS} "
        f"tokens batched (chunked prefill), the longest alone, then one sharing its first {SHARED} tokens"
    )
    rec.command(
        f"transformers DeepseekV4ForCausalLM.from_pretrained(OUT), its cache written 8-bit ({cache_dtype}), on the "
        "served tokens"
    )
    ok = _judge(rec, "tiny", model_dir, batches, SHARED, cache_dtype)
    rec.write(evidence_root)
    assert ok, rec.checks


@pytest.mark.vllm
@pytest.mark.gate
def test_kv8_mtp_tp2(tmp_path_factory, evidence_root):
    env = two_rank_cpu_bind("tensor parallelism 2")
    model_dir = make_tiny(tmp_path_factory.mktemp("dsv4_kv8_mtp") / "tiny", seed=4, mtp=True)
    rec = EvidenceRecord(model="deepseek_v4", gate="kv8_mtp_tp2")
    kwargs = {
        **KV8,
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "mp",
        "speculative_config": {"method": "mtp", "num_speculative_tokens": 2},
    }
    ps = prompts(LENGTHS, seed=63)
    batches = engine_run(model_dir, [ps, [ps[-1]]], MAX_TOKENS, kwargs, env)
    rec.command(
        f"vllm.LLM(make_tiny(OUT, seed=4, mtp=True), {kwargs}) greedy {MAX_TOKENS} tokens, prompts of {LENGTHS} "
        "tokens batched, then the longest alone"
    )
    ok = _judge(rec, "tp2_mtp", model_dir, batches)
    drafts = sum(b["counters"].get("vllm:spec_decode_num_draft_tokens", 0) for b in batches)
    rec.metric("draft_tokens", drafts)
    ok &= rec.check("the MTP layer drafted (its own 8-bit window cache)", drafts > 0, drafts)
    rec.write(evidence_root)
    assert ok, rec.checks


@pytest.mark.vllm
@pytest.mark.gate
def test_kv8_int8_served_through_the_npu_emulator(tmp_path, evidence_root):
    """The int8 cache on the NPU kernel path, served: the torch_npu CONTRACT EMULATOR installed as ``torch_npu``
    in the engine's processes and ``ASCEND_ADAPTERS_NPU_EMULATOR=1`` (``testing.npu_emulator``), so every cache
    write is an ``npu_dynamic_quant`` call its page allows, and the model's other NPU twins (the experts) run
    too. A contract check on CPU, NOT AN NPU RUN. Judged as the portable int8 gate: against the int8 reference,
    in float32 (the twins' float32 routes agree with the portable kernels to float32's accuracy, the bound's
    premise)."""
    model_dir = make_tiny(tmp_path / "tiny", seed=5)
    rec = EvidenceRecord(model="deepseek_v4", gate="kv8_int8_npu_emulated")
    ps = prompts(LENGTHS, seed=63)
    batches, ok = served_on_the_npu_path(rec, model_dir, "make_tiny(OUT, seed=5)", ps, MAX_TOKENS, KV8, tmp_path)
    ok &= _judge(rec, "emulated", model_dir, batches, cache_dtype="int8_per_token_head")
    rec.write(evidence_root)
    assert ok, rec.checks
