"""Gate: DeepSeek-V4 compiled by vLLM (served without ``enforce_eager``), and what of a step is safe to capture.

Served: the tiny float32 checkpoint, compilation on (vLLM's default; on CPU one Dynamo trace compiled
by inductor around the ``vllm::dsv4_attention`` and routed-expert ops), the parity gate's prompts
(inside the sliding window and ~10x beyond it) batched with chunked prefill (16 tokens a step, so
prompts split mid-window and mid-compression-block), then the longest and the shortest alone; then
the same at TP=2. vLLM's compilation counter, read in each worker, must show an AOT-compiled
function saved or loaded (0 when vLLM runs the model eager), and the logits must match transformers
within the eager gate's bound.

Capture safety (in process, no engine): a decode-only step and a mixed step run the model forward
under ``testing.capture.HostReads``, once on the portable kernels and once on the NPU implementations
through the torch_npu contract emulator (each torch_npu call one device kernel). Outside the
registered ops nothing reads a device value on the host: the compiled pieces are capture-safe; nor
does the attention op, which takes each request's boundaries and first position as host values
from the metadata builder. It still loops over the step's requests in Python, so its builder
declares no full-graph support (``AttentionCGSupport.NEVER``) and it runs eagerly between the
pieces; the test asserts that too, so the declaration changes with the code that justifies it.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from _dsv4_cases import hf_model, prompts, reference_fn

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.deepseek_v4.tiny import make_tiny
from ascend_adapters.testing.capture import PROBE, HostReads, compiled, emulated_npu_kernels
from ascend_adapters.testing.parity import compare, two_rank_cpu_bind, vllm_logits

# the eager parity gate's bound (test_deepseek_v4_parity.TOL); inductor only reorders float32 sums
# (~1e-6 relative on logits of magnitude ~10)
TOL = 1e-3
LENGTHS = (7, 16, 61, 150)  # window 16; CSA rate 4 with indexer top-k, HCA rate 16
MAX_TOKENS = 6
KWARGS = {"max_model_len": 256, "max_num_batched_tokens": 16, "max_num_seqs": 4, "enforce_eager": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = make_tiny(tmp_path_factory.mktemp("dsv4_compiled") / "tiny", seed=4)
    return d, reference_fn(hf_model(d))


def _serve_and_record(tiny, rec, llm_kwargs, env) -> bool:
    model_dir, ref = tiny
    ps = prompts(LENGTHS, seed=11)
    runs, counters = vllm_logits(
        model_dir, [ps, [ps[-1]], [ps[0]]], max_tokens=MAX_TOKENS, llm_kwargs=llm_kwargs, env=env, probe=PROBE
    )
    rec.command(
        f"vllm.LLM(<tiny>, float32, {llm_kwargs}) raw logits: 4 prompts batched (chunked prefill), then the "
        f"{LENGTHS[-1]}- and {LENGTHS[0]}-token prompts alone; LLM.apply_model reads vllm.compilation.counter "
        "in each worker; reference transformers DeepseekV4ForCausalLM float32"
    )
    rec.metric("compilation_counter_rank0", counters[0])
    ok = rec.check(
        f"vLLM compiled the model on each of {len(counters)} worker(s) (an AOT compile saved or loaded)",
        len(counters) >= 1 and all(compiled(c) for c in counters),
    )
    reports = {"batched+chunked": compare(runs[0], ref), "alone": compare([r[0] for r in runs[1:]], ref)}
    for label, rep in reports.items():
        rec.metric(f"{label}_max_abs_diff", rep.max_abs_diff)
        ok &= rec.check(f"{label}: logits within {TOL} of transformers", rep.max_abs_diff <= TOL, rep.as_dict())
        ok &= rec.check(f"{label}: greedy tokens identical", rep.tokens_identical, rep.first_divergence)
    same = runs[0][-1].gen_ids == runs[1][0].gen_ids and runs[0][0].gen_ids == runs[2][0].gen_ids
    ok &= rec.check("batched tokens equal the single-prompt tokens", same)
    return ok


@pytest.mark.vllm
@pytest.mark.gate
def test_compiled_parity(tiny, evidence_root):
    rec = EvidenceRecord(model="deepseek_v4", gate="compiled_parity", started=time.time())
    ok = _serve_and_record(tiny, rec, KWARGS, {})
    rec.skip("NPU graph capture", "no Ascend NPU here; capture safety is checked by the dispatch-mode tests")
    rec.write(evidence_root)
    assert ok, rec.checks


@pytest.mark.vllm
@pytest.mark.gate
def test_compiled_tp2_parity(tiny, evidence_root):
    env = two_rank_cpu_bind("tensor parallelism 2")
    rec = EvidenceRecord(model="deepseek_v4", gate="compiled_parity_tp2")
    kwargs = {**KWARGS, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    ok = _serve_and_record(tiny, rec, kwargs, env)
    rec.write(evidence_root)
    assert ok, rec.checks


# -- capture safety ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inprocess_model(tiny):
    from safetensors.torch import load_file
    from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    from ascend_adapters.deepseek_v4 import register
    from ascend_adapters.testing.inprocess import ensure_single_rank_parallel_state

    model_dir = tiny[0]
    register()
    mc = ModelConfig(model=str(model_dir), dtype="float32", max_model_len=256, skip_tokenizer_init=True)
    cfg = VllmConfig(model_config=mc, cache_config=CacheConfig(enable_prefix_caching=False))
    with set_current_vllm_config(cfg):
        ensure_single_rank_parallel_state()
        model = initialize_model(cfg)
        tensors = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        model.load_weights(iter(tensors.items()))
        process_weights_after_loading(model, mc, torch.device("cpu"))
    layers = [layer.self_attn for layer in model.model.layers]
    for attn in layers:  # random pages (block 0 is vLLM's null block): up to MAX_REQUESTS requests of 256 tokens
        for cache in attn.caches.values():
            per_request = -(-256 // cache.geometry.block_size)
            cache.kv_cache = torch.randn(1 + MAX_REQUESTS * per_request, cache.rows_per_block, cache.geometry.width)
    return cfg, model, layers


MAX_REQUESTS = 3


def _forward_under_detector(inprocess_model, query_lens: list[int], seq_lens: list[int]) -> HostReads:
    from vllm.forward_context import set_forward_context

    from ascend_adapters.deepseek_v4.backend import DeepseekV4CacheMetadata

    cfg, model, layers = inprocess_model
    qsl = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    md = {}
    for attn in layers:
        for cache in attn.caches.values():
            per_request = (cache.kv_cache.shape[0] - 1) // MAX_REQUESTS
            table = torch.arange(1, 1 + len(query_lens) * per_request).view(len(query_lens), per_request)
            md[cache.layer_name] = DeepseekV4CacheMetadata(
                query_start_loc=qsl, first_positions=[s - q for q, s in zip(query_lens, seq_lens)], block_table=table
            )
    tokens = torch.randint(2, 500, (qsl[-1],))
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    mode = HostReads()
    with set_forward_context(md, cfg, num_tokens=len(tokens)):
        with torch.inference_mode(), mode:
            # the plain forward (not the compiled __call__): what vLLM traces and a graph captures
            out = model.model.forward(tokens, positions)
    assert torch.isfinite(out).all()
    return mode


# the torch_npu operators DeepSeek-V4's NPU implementations call in a step: common.swiglu (clamped,
# the shared expert) and common.swiglu_experts (the routed experts)
NPU_KERNELS = {"torch_npu.npu_clipped_swiglu", "torch_npu.npu_grouped_matmul"}


@pytest.mark.vllm
@pytest.mark.parametrize("kernels", ["portable", "emulated_npu"])
@pytest.mark.parametrize(
    "query_lens,seq_lens", [([1, 1, 1], [30, 9, 140]), ([1, 12], [25, 40])], ids=["decode", "mixed"]
)
def test_compiled_pieces_read_no_device_value_on_host(inprocess_model, query_lens, seq_lens, kernels):
    with emulated_npu_kernels() if kernels == "emulated_npu" else contextlib.nullcontext():
        mode = _forward_under_detector(inprocess_model, query_lens, seq_lens)
    layers = inprocess_model[2]
    assert mode.custom_ops.count("vllm.dsv4_attention.default") == len(layers)
    assert set(mode.kernels) == (NPU_KERNELS if kernels == "emulated_npu" else set()), mode.kernels
    assert mode.outside == [], mode.outside
    # nor inside the attention op (the builder gives it host values); the routed experts sort their
    # routes on the host inside their own op, which runs eagerly between the pieces too
    assert set(mode.inside) <= {"vllm.ascend_adapters_swiglu_experts.default"}, mode.inside
    # the attention op loops over the step's requests in Python, on the builder's host lists: a captured
    # step would replay the loop of the step it was captured in. Why its builder declares no full graph:
    from vllm.v1.attention.backend import AttentionCGSupport

    from ascend_adapters.deepseek_v4.backend import DeepseekV4CacheMetadataBuilder

    assert DeepseekV4CacheMetadataBuilder._cudagraph_support == AttentionCGSupport.NEVER
