"""Gate: GLM-DSA with an 8-bit ``--kv-cache-dtype`` (the 8-bit latent cache, ``common.kernels.kv8``) against
transformers' GlmMoeDsaForCausalLM whose cache writes go through the documented quantisation
(``_glm_dsa_ref.kv8_write_cache``: the OCP E4M3 rounding for ``fp8``, npu_dynamic_quant's int8 formula for
``int8_per_token_head``, written out in ``testing.kv8_reference``, no code shared with the adapter).

Bound: ``testing.kv8_reference`` (its module doc derives it from each format's step).

Served (one engine, eager, float32, prefix caching on): the sparse tiny (index_topk 8) with four prompts of
3..100 tokens batched under chunked prefill (32 tokens a step), the longest alone, then a prompt sharing
the longest's first 64 tokens (4 blocks of 16: hit from the 8-bit blocks), in each format. Then the MTP-fitted
checkpoint at TP=2 with 3 MTP drafts a step (fp8): the target's logits against the same reference, drafts
accepted.
"""

from __future__ import annotations

import pytest
from _glm_dsa_ref import Reference, build, random_prompts

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.testing.engine_worker import engine_run
from ascend_adapters.testing.kv8_reference import PARITY_GATES, judge, served_on_the_npu_path
from ascend_adapters.testing.parity import two_rank_cpu_bind

KV8 = {
    "dtype": "float32",
    "enforce_eager": True,
    "kv_cache_dtype": "fp8",
    "max_model_len": 160,
    "kv_cache_memory_bytes": 64 << 20,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 32,
    "block_size": 16,
}
LENGTHS = (3, 21, 64, 100)
SHARED = 64  # tokens of the longest prompt a later prompt repeats: 4 whole blocks
MAX_TOKENS = 12


def _judge(rec, label: str, ckpt, batches, shared: int | None = None, cache_dtype: str = "fp8") -> bool:
    return judge(rec, label, batches, Reference(ckpt, kv8=cache_dtype), Reference(ckpt), shared)


@pytest.fixture(scope="module")
def sparse_ckpt(tmp_path_factory):
    return build(tmp_path_factory.mktemp("glm_dsa_kv8"), "tiny-sparse", index_topk=8)


@pytest.mark.vllm
@pytest.mark.gate
@pytest.mark.parametrize("cache_dtype", ["fp8", "int8_per_token_head"])
def test_kv8_sparse_batched_chunked_prefix_hit(sparse_ckpt, evidence_root, cache_dtype):
    rec = EvidenceRecord(model="glm_dsa", gate=PARITY_GATES[cache_dtype])
    prompts = random_prompts(LENGTHS, seed=2)
    shared = prompts[-1][:SHARED] + random_prompts((30,), seed=9)[0]
    kwargs = {**KV8, "kv_cache_dtype": cache_dtype, "enable_prefix_caching": True}
    batches = engine_run(sparse_ckpt, [prompts, [prompts[-1]], [shared]], MAX_TOKENS, kwargs)
    rec.command(
        f"vllm.LLM({sparse_ckpt.name}, {kwargs}) greedy {MAX_TOKENS} tokens, raw logits: prompts of {LENGTHS} "
        f"tokens batched (chunked prefill), the longest alone, then one sharing its first {SHARED} tokens"
    )
    rec.command(
        f"transformers GlmMoeDsaForCausalLM.from_pretrained(OUT) with kv8_write_cache({cache_dtype}), on the served "
        "tokens"
    )
    ok = _judge(rec, "sparse", sparse_ckpt, batches, SHARED, cache_dtype)
    rec.write(evidence_root)
    assert ok, rec.checks


@pytest.mark.vllm
@pytest.mark.gate
def test_kv8_mtp_tp2(evidence_root, tmp_path_factory):
    from _glm_dsa_ref import add_released_extras

    from ascend_adapters.testing.mtp_fit import make_glm_dsa_mtp_fitted

    env = two_rank_cpu_bind("tensor parallelism 2")
    ckpt, _ = make_glm_dsa_mtp_fitted(tmp_path_factory.mktemp("glm_dsa_kv8_mtp") / "fitted")
    add_released_extras(ckpt)
    rec = EvidenceRecord(model="glm_dsa", gate="kv8_mtp_tp2")
    drafts = 3
    kwargs = {
        **KV8,
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "mp",
        "speculative_config": {"method": "mtp", "num_speculative_tokens": drafts},
    }
    prompts = random_prompts(LENGTHS, seed=21)
    batches = engine_run(ckpt, [prompts, [prompts[-1]]], MAX_TOKENS, kwargs, env)
    rec.command(
        f"mtp_fit.make_glm_dsa_mtp_fitted(OUT); vllm.LLM(OUT, {kwargs}) greedy {MAX_TOKENS} tokens, prompts of "
        f"{LENGTHS} tokens batched, then the longest alone"
    )
    ok = _judge(rec, "tp2_mtp", ckpt, batches)
    per_pos = [
        sum(b["counters"].get("vllm:spec_decode_num_accepted_tokens_per_pos", [0] * drafts)[j] for b in batches)
        for j in range(drafts)
    ]
    rec.metric("accepted_per_position", per_pos)
    ok &= rec.check(f"drafts accepted at every one of the {drafts} draft positions", all(n > 0 for n in per_pos))
    rec.write(evidence_root)
    assert ok, rec.checks


@pytest.mark.vllm
@pytest.mark.gate
def test_kv8_int8_served_through_the_npu_emulator(sparse_ckpt, tmp_path, evidence_root):
    """The int8 cache on the NPU kernel path, served: the torch_npu CONTRACT EMULATOR installed as ``torch_npu``
    in the engine's processes and ``ASCEND_ADAPTERS_NPU_EMULATOR=1`` (``testing.npu_emulator``), so every cache
    write is an ``npu_dynamic_quant`` call its page allows, and the model's other NPU twins run too. A contract
    check on CPU, NOT AN NPU RUN. Judged as the portable int8 gate: against the int8 reference, in float32 (the
    twins' float32 routes agree with the portable kernels to float32's accuracy, the bound's premise)."""
    rec = EvidenceRecord(model="glm_dsa", gate="kv8_int8_npu_emulated")
    prompts = random_prompts(LENGTHS, seed=4)
    batches, ok = served_on_the_npu_path(rec, sparse_ckpt, sparse_ckpt.name, prompts, MAX_TOKENS, KV8, tmp_path)
    ok &= _judge(rec, "emulated", sparse_ckpt, batches, cache_dtype="int8_per_token_head")
    rec.write(evidence_root)
    assert ok, rec.checks
