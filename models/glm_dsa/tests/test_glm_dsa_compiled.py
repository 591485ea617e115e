"""Gate: GLM-DSA compiled by vLLM (served without ``enforce_eager``), and its steps safe to capture.

Served: the sparse checkpoint (index_topk 8, prompts up to 12x longer), compilation on (vLLM's
default; on CPU one Dynamo trace compiled by inductor around the ``vllm::glm_dsa_attention``
op), four prompts batched with chunked prefill, then the longest and the shortest alone; then
the same at TP=2. vLLM's compilation counter, read in the worker, must show an AOT-compiled
function saved (0 when vLLM runs the model eager) and the logits must match transformers within
the eager gate's bound.

Capture safety (in process, no engine): a decode-only step and a mixed step (decodes and a
prefill chunk) run the model forward under a dispatch mode that records every op that reads a
device value on the host or has a data-dependent output shape (PyTorch tags those ops), looking
inside the registered attention op as well, once on the portable kernels and once on the NPU
implementations through the torch_npu contract emulator (each torch_npu call one device kernel).
The attention builder declares uniform batches capturable (``AttentionCGSupport.UNIFORM_BATCH``, see
backend.py); test_glm_dsa_graph captures a decode and an MTP verification step and replays them.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from _glm_dsa_ref import Reference, build, random_prompts, step_metadata

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.testing.capture import PROBE, HostReads, compiled, emulated_npu_kernels
from ascend_adapters.testing.parity import compare, two_rank_cpu_bind, vllm_logits

# the eager parity gate's bound (test_glm_dsa_parity.TOL); inductor only reorders float32 sums
# (~1e-6 relative on logits of magnitude ~10)
TOL = 1e-3
KWARGS = {
    "max_model_len": 160,
    "max_num_batched_tokens": 32,
    "max_num_seqs": 4,
    "block_size": 16,
    "enforce_eager": False,
}


@pytest.fixture(scope="module")
def sparse_ckpt(tmp_path_factory):
    return build(tmp_path_factory.mktemp("glm_dsa_compiled"), "tiny-sparse", index_topk=8)


def _serve_and_compare(ckpt, prompts, llm_kwargs, env):
    runs, counters = vllm_logits(
        ckpt, [prompts, [prompts[-1]], [prompts[0]]], max_tokens=10, llm_kwargs=llm_kwargs, env=env, probe=PROBE
    )
    ref = Reference(ckpt)
    reports = {"batched+chunked": compare(runs[0], ref), "alone": compare([r[0] for r in runs[1:]], ref)}
    same = runs[0][-1].gen_ids == runs[1][0].gen_ids and runs[0][0].gen_ids == runs[2][0].gen_ids
    return reports, counters, same


def _record(rec, reports, counters, same) -> bool:
    rec.metric("compilation_counter_rank0", counters[0])
    ok = rec.check(
        f"vLLM compiled the model on each of {len(counters)} worker(s) (an AOT compile saved or loaded)",
        len(counters) >= 1 and all(compiled(c) for c in counters),
    )
    for label, rep in reports.items():
        rec.metric(f"{label}_max_abs_diff", rep.max_abs_diff)
        ok &= rec.check(f"{label}: logits within {TOL} of transformers", rep.max_abs_diff <= TOL, rep.as_dict())
        ok &= rec.check(f"{label}: greedy tokens identical", rep.tokens_identical, rep.first_divergence)
    ok &= rec.check("batched tokens equal the single-prompt tokens", same)
    return ok


@pytest.mark.vllm
@pytest.mark.gate
def test_compiled_sparse_parity(sparse_ckpt, evidence_root):
    started = time.time()
    rec = EvidenceRecord(model="glm_dsa", gate="compiled_parity", started=started)
    prompts = random_prompts([3, 21, 64, 100], seed=2)
    reports, counters, same = _serve_and_compare(sparse_ckpt, prompts, KWARGS, {})
    rec.command(
        f"vllm.LLM(<tiny, index_topk 8>, dtype=float32, {KWARGS}) raw logits; 4 prompts batched (chunked "
        "prefill, 32 tokens/step), then the 100- and 3-token prompts alone; LLM.apply_model reads "
        "vllm.compilation.counter in the worker"
    )
    ok = _record(rec, reports, counters, same)
    rec.skip("NPU graph capture", "no Ascend NPU here; capture safety is checked by the dispatch-mode tests")
    rec.write(evidence_root)
    assert ok, rec.checks


@pytest.mark.vllm
@pytest.mark.gate
def test_compiled_tp2_parity(sparse_ckpt, evidence_root):
    env = two_rank_cpu_bind("tensor parallelism 2")
    rec = EvidenceRecord(model="glm_dsa", gate="compiled_parity_tp2")
    prompts = random_prompts([5, 30, 47], seed=12)
    kwargs = {**KWARGS, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    reports, counters, same = _serve_and_compare(sparse_ckpt, prompts, kwargs, env)
    rec.command(f"vllm.LLM(<tiny, index_topk 8>, dtype=float32, {kwargs}) raw logits, batched then alone")
    ok = _record(rec, reports, counters, same)
    rec.write(evidence_root)
    assert ok, rec.checks


# -- capture safety ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inprocess_model(sparse_ckpt):
    from safetensors.torch import load_file
    from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    from ascend_adapters.glm_dsa import register
    from ascend_adapters.testing.inprocess import ensure_single_rank_parallel_state

    register()
    mc = ModelConfig(model=str(sparse_ckpt), dtype="float32", max_model_len=160, skip_tokenizer_init=True)
    cfg = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=16, enable_prefix_caching=False))
    with set_current_vllm_config(cfg):
        ensure_single_rank_parallel_state()
        model = initialize_model(cfg)
        model.load_weights(iter(load_file(str(sparse_ckpt / "model.safetensors")).items()))
        process_weights_after_loading(model, mc, torch.device("cpu"))
    layers = [layer.self_attn for layer in model.model.layers]
    for attn in layers:
        attn.kv_cache = torch.randn(8, 16, attn.row_dim)  # 8 blocks of 16 tokens
    return cfg, model, layers


def _forward_under_detector(inprocess_model, query_lens, seq_lens):
    from vllm.forward_context import set_forward_context

    cfg, model, layers = inprocess_model
    md = step_metadata(query_lens, seq_lens)
    tokens = torch.randint(1, 500, (md.num_actual_tokens,))
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    mode = HostReads()
    with set_forward_context({a.layer_name: md for a in layers}, cfg, num_tokens=len(tokens)):
        with torch.inference_mode(), mode:
            # the plain forward (not the compiled __call__): what vLLM traces and a graph captures
            out = model.model.forward(tokens, positions)
    return out, mode


# the torch_npu operators GLM-DSA's NPU implementations call in a step (common.rope_interleaved, glm_dsa.cache_rows)
NPU_KERNELS = {"torch_npu.npu_rotary_mul", "torch_npu.npu_gather_sparse_index"}


# a decode-only step; and two decodes with a prefill chunk of 12 tokens continuing a 20-token context
@pytest.mark.vllm
@pytest.mark.parametrize("kernels", ["portable", "emulated_npu"])
@pytest.mark.parametrize(
    "query_lens,seq_lens", [([1, 1, 1], [30, 9, 17]), ([1, 1, 12], [25, 6, 32])], ids=["decode", "mixed"]
)
def test_step_reads_no_device_value_on_host(inprocess_model, query_lens, seq_lens, kernels):
    with emulated_npu_kernels() if kernels == "emulated_npu" else contextlib.nullcontext():
        out, mode = _forward_under_detector(inprocess_model, query_lens, seq_lens)
    assert mode.custom_ops.count("vllm.glm_dsa_attention.default") == len(inprocess_model[2])
    assert set(mode.kernels) == (NPU_KERNELS if kernels == "emulated_npu" else set()), mode.kernels
    assert mode.seen == [], mode.seen
    assert torch.isfinite(out).all()


@pytest.mark.vllm
def test_speculative_step_joins_the_decode_call_unchanged(inprocess_model):
    """A speculative step's requests of 1 + k tokens (and short prefills) go to the batched decode call,
    each token with its causal context (backend.step_metadata): the same outputs as one prefill call per
    request, with the indexer selecting (contexts beyond index_topk 8; random cache, no score ties)."""
    from vllm.forward_context import set_forward_context

    cfg, model, layers = inprocess_model
    query_lens, seq_lens = [4, 3, 2, 4], [20, 3, 31, 12]
    tokens = torch.randint(1, 500, (sum(query_lens),), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    outs = []
    for decode_query_max in (1, 4):
        md = step_metadata(query_lens, seq_lens, decode_query_max)
        assert len(md.prefills) == (4 if decode_query_max == 1 else 0)
        with set_forward_context({a.layer_name: md for a in layers}, cfg, num_tokens=len(tokens)):
            with torch.inference_mode():
                outs.append(model.model.forward(tokens, positions))
    assert float((outs[0] - outs[1]).abs().max()) < 1e-5


def test_policy_splits_at_the_op_the_model_registers():
    """The start-up policy names the attention op without importing the model; it must be the model's."""
    import ascend_adapters.glm_dsa.model  # noqa: F401  (registers the op)
    from ascend_adapters.glm_dsa import SPLITTING_OPS

    for op in SPLITTING_OPS:
        namespace, name = op.split("::")
        assert hasattr(getattr(torch.ops, namespace), name), op
