"""RWKV-7's steps as a device graph holds them: captured once, replayed on new inputs (issue #46).

In process, no engine, on the tiny checkpoint (``tiny.make_tiny``: 2 layers, 2 heads of 32). A step
is the model forward with its inputs as tensors: token ids, positions, the metadata's device tensors
(query starts, sequence lengths, state rows) and every layer's four state tensors, swapped into the
layers inside the step function. ``testing.capture.capture_step`` records the step's ops once (the
state ops traced through their bodies) and replays them on new inputs of the same shapes, as a device
graph does; whatever the step decided on the host from data while it was recorded is frozen. The
state backend's builder declares ``UNIFORM_BATCH``; these tests are that claim:

* a decode step (one token per request) and a verification step of ``1 + 3`` tokens per request
  (n-gram speculation), each captured and replayed on new tokens, positions, sequence lengths
  (a request fresh in one and continued in the other), state rows and state contents (under
  speculation: state counts that make another row the one to resume from), equal the eager step on
  the same inputs, outputs and every state tensor after, bit for bit: the replay runs the same
  CPU kernels on the same values in the same order;
* the same with vLLM's padding of a captured batch (a request of no tokens and sequence length 0,
  its state index -1 as vLLM's speculative linear-attention builders hand it under full graphs, or the null block as vLLM's
  block table holds it): no state row but the real requests' and the null block changes, and the
  real tokens' outputs equal the unpadded step's (torch's float32 tolerance for the same computation
  in another batch shape);
* the comparison can fail: a step that reads the sequence lengths on the host, replayed on other
  lengths, differs from its eager run;
* a decode step dispatches as many ops at batch 16 as at batch 1 (at most 1.25x, the issue's bound),
  reading no device value on the host; a step with prefills reads none either (its WKV chunks are
  planned on host values the builder takes from vLLM's host copy of the query starts).
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from _rwkv7_cases import build_inprocess_model, step_metadata, with_tensors

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.testing.capture import HostReads, capture_step

pytestmark = pytest.mark.vllm

STATE_ROWS = 72  # row 0 is the null block (vLLM's NULL_BLOCK_ID), which no request here owns
DRAFTS = 3


@pytest.fixture(scope="module")
def inprocess_model(tmp_path_factory):
    from ascend_adapters.rwkv7.tiny import make_tiny

    return build_inprocess_model(make_tiny(tmp_path_factory.mktemp("rwkv7_graph") / "tiny"), state_rows=STATE_ROWS)


def _step(cfg, model, q_cpu, num_decodes, *, speculative=False, num_tokens=None, read_seq_lens_on_host=False):
    """``step(tokens, positions, query_start_loc, seq_lens, rows, *states)``: the model forward of one step
    of requests with query starts ``q_cpu``, whose host values the builder made before the step (fixed by
    the step's shape). With ``read_seq_lens_on_host`` the step first reads the sequence lengths on the
    host, as a builder reading the device copy inside a captured step would: the graph freezes them."""
    from vllm.forward_context import set_forward_context

    layers = model.model.layers
    n = len(q_cpu) - 1
    shape = (n, 1 + DRAFTS) if speculative else (n,)
    host = step_metadata(q_cpu, num_decodes, None, torch.zeros(shape, dtype=torch.int32), num_tokens=num_tokens)

    def step(tokens, positions, query_start_loc, seq_lens, rows, *states):
        if read_seq_lens_on_host:
            seq_lens = torch.tensor(seq_lens.tolist(), dtype=seq_lens.dtype)
        md = with_tensors(host, query_start_loc, seq_lens, rows)
        saved = [layer.kv_cache for layer in layers]
        for i, layer in enumerate(layers):
            layer.kv_cache = tuple(states[4 * i : 4 * i + 4])
        try:
            with set_forward_context({layer.prefix: md for layer in layers}, cfg, num_tokens=tokens.shape[0]):
                return model.model.forward(tokens, positions)
        finally:
            for layer, kv in zip(layers, saved):
                layer.kv_cache = kv

    return step


def _inputs(model, seed, q_cpu, seq_lens, rows, *, num_tokens=None, resume=None):
    """The step's inputs: random token ids and state contents; positions from the sequence lengths.
    ``resume`` (speculation): per request, the index of the row holding the state to resume from (its
    token count is the request's context; every other row's count is -1, unused), or None."""
    g = torch.Generator().manual_seed(seed)
    n_tok = num_tokens if num_tokens is not None else q_cpu[-1]
    positions = torch.zeros(n_tok, dtype=torch.long)
    for i, length in enumerate(seq_lens):
        q = q_cpu[i + 1] - q_cpu[i]
        positions[q_cpu[i] : q_cpu[i + 1]] = torch.arange(length - q, length)
    counts = torch.randint(0, 64, (STATE_ROWS, 1), generator=g)
    if resume is not None:
        counts.fill_(-1)
        for i, (row_list, j) in enumerate(zip(rows, resume)):
            if j is not None:
                counts[row_list[j]] = seq_lens[i] - (q_cpu[i + 1] - q_cpu[i])
    states = []
    for layer in model.model.layers:
        for template in layer.kv_cache:
            if template.is_floating_point():
                states.append(torch.randn(template.shape, generator=g).to(template.dtype))
            else:
                states.append(counts.clone())
    return [
        torch.randint(1, model.config.vocab_size, (n_tok,), generator=g),
        positions,
        torch.tensor(q_cpu, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(rows, dtype=torch.int32),
        *states,
    ]


def _run(step, inputs):
    """``(output, states after)`` of ``step`` (eager, or a captured graph) on a copy of ``inputs``."""
    inputs = [t.clone() for t in inputs]
    with torch.no_grad():
        out = step(*inputs)
    return out, inputs[5:]


def _same(a, b) -> bool:
    (out_a, states_a), (out_b, states_b) = a, b
    return torch.equal(out_a, out_b) and all(torch.equal(x, y) for x, y in zip(states_a, states_b))


def _capture(step, inputs):
    with torch.no_grad():
        return capture_step(step, *[t.clone() for t in inputs])


# (q_cpu, rows, seq_lens at capture, seq_lens at replay, rows at replay, resume at capture, resume at replay)
DECODE = ([0, 1, 2, 3, 4], [5, 1, 9, 3], [7, 1, 30, 12], [1, 9, 31, 40], [2, 6, 9, 4])
_R = [[1 + 4 * i + j for j in range(1 + DRAFTS)] for i in range(4)]  # 1 + 3 rows per request
VERIFY = ([0, 4, 8, 12], _R[:3], [10, 4, 33], [20, 12, 4], [_R[3], _R[0], _R[1]], [0, None, 2], [3, 1, None])


def test_builder_declares_uniform_batch():
    from vllm.v1.attention.backend import AttentionCGSupport

    from ascend_adapters.rwkv7.model import Rwkv7StateBackend

    assert Rwkv7StateBackend.get_builder_cls().get_cudagraph_support(None, None) is AttentionCGSupport.UNIFORM_BATCH


def test_state_backend_is_vllms_linear_attention_with_rwkv7s_own_builder(inprocess_model):
    """The state metadata is built on vLLM's linear-attention backend by RWKV-7's own builder, not on
    another model's (Bailing's); under speculation a request of up to ``1 + k`` tokens is a decode."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends import linear_attn

    from ascend_adapters.rwkv7.model import Rwkv7StateBackend, Rwkv7StateMetadata, Rwkv7StateMetadataBuilder

    assert Rwkv7StateBackend.__mro__[1] is linear_attn.LinearAttentionBackend
    assert Rwkv7StateMetadataBuilder.__mro__[1] is linear_attn.LinearAttentionMetadataBuilder
    assert Rwkv7StateMetadata.__mro__[1] is linear_attn.LinearAttentionMetadata
    cfg, model = inprocess_model
    layers = model.model.layers
    with set_current_vllm_config(cfg):
        builder = Rwkv7StateMetadataBuilder(
            layers[0].get_kv_cache_spec(cfg), [layer.prefix for layer in layers], cfg, torch.device("cpu")
        )
    assert builder.reorder_batch_threshold == 1 + cfg.num_speculative_tokens


def test_builder_takes_host_values_from_the_host_copies(inprocess_model):
    """The builder's device tensors on the meta device (no values: a host read of one raises): a step
    of two decodes and two prefills builds from ``query_start_loc_cpu`` alone."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from ascend_adapters.rwkv7.model import Rwkv7StateMetadataBuilder

    cfg, model = inprocess_model
    layers = model.model.layers
    with set_current_vllm_config(cfg):
        builder = Rwkv7StateMetadataBuilder(
            layers[0].get_kv_cache_spec(cfg), [layer.prefix for layer in layers], cfg, torch.device("cpu")
        )
    q = torch.tensor([0, 1, 2, 7, 16], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=q.to("meta"),
        query_start_loc_cpu=q,
        seq_lens=torch.tensor([5, 9, 5, 20], dtype=torch.int32).to("meta"),
        num_reqs=4,
        num_actual_tokens=16,
        max_query_len=9,
        max_seq_len=20,
        block_table_tensor=torch.tensor([[3], [4], [5], [6]], dtype=torch.int32).to("meta"),
        slot_mapping=torch.zeros(16, dtype=torch.long).to("meta"),
    )
    md = builder.build(0, common)
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens) == (2, 2, 2)
    assert md.prefill_bounds == (0, 5, 14) and md.decode_width == 1 and md.split is None


@pytest.mark.parametrize("case", ["decode", "verify"])
def test_captured_step_replays_equal_to_eager_on_new_inputs(inprocess_model, case):
    cfg, model = inprocess_model
    if case == "decode":
        q_cpu, rows, lens, new_lens, new_rows = DECODE
        resume = new_resume = None
    else:
        q_cpu, rows, lens, new_lens, new_rows, resume, new_resume = VERIFY
    step = _step(cfg, model, q_cpu, len(q_cpu) - 1, speculative=case == "verify")
    first = _inputs(model, 0, q_cpu, lens, rows, resume=resume)
    graph = _capture(step, first)
    assert _same(_run(graph, first), _run(step, first))
    new = _inputs(model, 1, q_cpu, new_lens, new_rows, resume=new_resume)
    replayed, eager = _run(graph, new), _run(step, new)
    assert _same(replayed, eager)
    # the step did write the state: every real request's rows moved on
    written = sorted({r for row in new_rows for r in (row if isinstance(row, list) else [row])})
    for before, after in zip(new[5:], eager[1]):
        assert not torch.equal(before[written], after[written])


@pytest.mark.parametrize("case", ["decode", "verify"])
def test_padded_captured_batch_touches_only_its_requests_and_the_null_block(inprocess_model, case):
    """vLLM pads a captured decode batch with requests of no tokens and sequence length 0 (and pads the
    tokens to the graph's size)."""
    cfg, model = inprocess_model
    if case == "decode":
        q_cpu, rows, lens, _, _ = DECODE
        resume = None
        pad_q, pad_rows, pad_lens = q_cpu + [q_cpu[-1]], rows + [-1], lens + [0]  # PAD_SLOT_ID, a full-graph index
    else:
        q_cpu, rows, lens, _, _, resume, _ = VERIFY
        pad_q, pad_rows, pad_lens = q_cpu + [q_cpu[-1]], rows + [[0] * (1 + DRAFTS)], lens + [0]  # block table
        resume = resume + [None]
    n_real = q_cpu[-1]
    padded_tokens = pad_q[-1] + (pad_q[1] - pad_q[0])  # the padding request's share of the graph's tokens
    nd = len(pad_q) - 1
    step = _step(cfg, model, pad_q, nd, speculative=case == "verify", num_tokens=padded_tokens)
    inputs = _inputs(model, 2, pad_q, pad_lens, pad_rows, num_tokens=padded_tokens, resume=resume)
    graph = _capture(step, inputs)
    replayed, eager = _run(graph, inputs), _run(step, inputs)
    assert _same(replayed, eager)
    real = sorted({r for row in rows for r in (row if isinstance(row, list) else [row])})
    others = [r for r in range(1, STATE_ROWS) if r not in real]
    for before, after in zip(inputs[5:], eager[1]):
        assert torch.equal(before[others], after[others])
    # the real requests as an unpadded step on the same tokens and states
    unpadded = [inputs[0][:n_real], inputs[1][:n_real], inputs[2][:nd], inputs[3][: nd - 1], inputs[4][: nd - 1]]
    out, states = _run(_step(cfg, model, q_cpu, nd - 1, speculative=case == "verify"), unpadded + inputs[5:])
    torch.testing.assert_close(eager[0][:n_real], out)
    for padded_state, state in zip(eager[1], states):
        torch.testing.assert_close(padded_state[real], state[real])


def test_replay_of_a_step_that_reads_on_the_host_differs(inprocess_model):
    """The comparison can fail: the sequence lengths read on the host are frozen at capture, so a replay
    on other lengths (request 0 fresh, request 1 continued) differs from the same step run eagerly,
    while eagerly that step equals the real one."""
    cfg, model = inprocess_model
    q_cpu, rows, lens, new_lens, new_rows = DECODE
    reading = _step(cfg, model, q_cpu, len(q_cpu) - 1, read_seq_lens_on_host=True)
    graph = _capture(reading, _inputs(model, 0, q_cpu, lens, rows))
    new = _inputs(model, 1, q_cpu, new_lens, new_rows)
    assert _same(_run(reading, new), _run(_step(cfg, model, q_cpu, len(q_cpu) - 1), new))
    assert not _same(_run(graph, new), _run(reading, new))


def _launches(cfg, model, batch: int, width: int) -> HostReads:
    q_cpu = [width * i for i in range(batch + 1)]
    rows = [[1 + (1 + DRAFTS) * i + j for j in range(1 + DRAFTS)] for i in range(batch)] if width > 1 else None
    rows = rows or list(range(1, batch + 1))
    resume = [0] * batch if width > 1 else None
    inputs = _inputs(model, 3, q_cpu, [30 + i for i in range(batch)], rows, resume=resume)
    step = _step(cfg, model, q_cpu, batch, speculative=width > 1)  # the builder's work, before the step
    mode = HostReads()
    with torch.no_grad(), mode:
        step(*inputs)
    return mode


@pytest.mark.gate
@pytest.mark.parametrize("width", [1, 1 + DRAFTS], ids=["decode", "verify"])
def test_step_ops_do_not_grow_with_the_batch(inprocess_model, width, evidence_root):
    cfg, model = inprocess_model
    name = "decode" if width == 1 else "verify"
    rec = EvidenceRecord(model="rwkv7", gate=f"{name}_step_ops", started=time.time())
    rec.command(
        f"in process: the tiny checkpoint's model forward (float32, portable kernels) over one {name} step "
        f"({width} token(s) per request) under testing.capture.HostReads, at 1 and 16 requests"
    )
    one, sixteen = _launches(cfg, model, 1, width), _launches(cfg, model, 16, width)
    for batch, mode in ((1, one), (16, sixteen)):
        rec.metric(f"ops_batch_{batch}", mode.launches)
        rec.check(f"batch {batch}: no device value read on the host", mode.seen == [], mode.seen[:5])
    rec.metric("ops_ratio_16_over_1", round(sixteen.launches / one.launches, 4))
    rec.check(
        "ops at batch 16 <= 1.25 x ops at batch 1",
        sixteen.launches <= 1.25 * one.launches,
        {"1": one.launches, "16": sixteen.launches},
    )
    rec.write(evidence_root)
    assert rec.passed, rec.checks


def test_step_with_prefills_reads_no_device_value_on_host(inprocess_model):
    """Two decodes (one fresh), a fresh prompt and a prompt continued by chunked prefill."""
    cfg, model = inprocess_model
    q_lens, lens, rows = [1, 1, 5, 9], [7, 1, 5, 20], [4, 2, 6, 9]
    q_cpu = [0, *itertools.accumulate(q_lens)]
    inputs = _inputs(model, 4, q_cpu, lens, rows)
    step = _step(cfg, model, q_cpu, 2)  # the builder's work (host values from the host copy), before the step
    mode = HostReads()
    with torch.no_grad(), mode:
        step(*inputs)
    assert mode.seen == [], mode.seen


def test_step_with_prefills_copies_nothing_from_the_host_per_layer(inprocess_model):
    """The WKV chunk kernel of every layer takes the prefills' bounds on the device from the step's
    metadata (``_Batch.prefill_cu``, made once per step), and the state ops zero rows in place: a step
    builds no tensor from host data (``aten.lift_fresh``: ``torch.tensor`` of a list, indexing with a
    list, a Python number assigned into a tensor), on a device each a host-to-device copy. The old code
    built seven per layer in this step (the kernel's starts, ends and its sequence order twice; three
    assigned zeros)."""
    cfg, model = inprocess_model
    q_lens, lens, rows = [1, 5, 40, 2], [7, 5, 50, 2], [4, 6, 9, 3]  # a decode, then three prompts (reordered)
    q_cpu = [0, *itertools.accumulate(q_lens)]
    inputs = _inputs(model, 5, q_cpu, lens, rows)
    step = _step(cfg, model, q_cpu, 1)
    mode = HostReads()
    with torch.no_grad(), mode:
        step(*inputs)
    assert mode.ops["aten.lift_fresh.default"] == 0, dict(mode.ops)
