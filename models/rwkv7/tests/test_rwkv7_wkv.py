"""The chunked and step forms of the WKV-7 recurrence against the plain reference."""

from __future__ import annotations

import pytest
import torch

from ascend_adapters.common import dispatch
from ascend_adapters.rwkv7.kernels import wkv7_chunk, wkv7_reference, wkv7_reference_varlen, wkv7_step


def _inputs(T, H, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    r, k, v = (torch.randn(T, H, N, generator=g) for _ in range(3))
    w = torch.exp(-0.6065306597126334 * torch.sigmoid(3 * torch.randn(T, H, N, generator=g)))
    kk = torch.nn.functional.normalize(torch.randn(T, H, N, generator=g), dim=-1)
    a_gate = torch.sigmoid(torch.randn(T, H, N, generator=g))
    return r, w, k, v, -kk, kk * a_gate


@pytest.mark.parametrize(
    "T,H,N,chunk", [(1, 2, 32, 32), (31, 3, 32, 32), (100, 2, 64, 32), (77, 1, 64, 16), (130, 2, 128, 64)]
)
@pytest.mark.parametrize("init", [False, True])
def test_chunk_and_step_match_reference(T, H, N, chunk, init):
    x = _inputs(T, H, N, seed=T + N)
    s0 = torch.randn(H, N, N) if init else torch.zeros(H, N, N)
    y_ref, s_ref = wkv7_reference(*x, s0)
    scale = y_ref.abs().max()

    y, s = wkv7_chunk(*x, s0[None], chunk_size=chunk)
    assert (y - y_ref).abs().max() <= 2e-6 * scale
    assert (s[0] - s_ref).abs().max() <= 2e-6 * s_ref.abs().max()

    s = s0.clone()[None].contiguous()
    ys = torch.stack([wkv7_step(*(t[i : i + 1] for t in x), s)[0] for i in range(T)])
    assert (ys - y_ref).abs().max() <= 2e-6 * scale
    assert (s[0] - s_ref).abs().max() <= 2e-6 * s_ref.abs().max()


def test_chunk_continues_from_state():
    """Two chunked calls (prompt split as chunked prefill does) == one call."""
    x = _inputs(90, 2, 64, seed=3)
    y_all, s_all = wkv7_chunk(*x)
    y1, s = wkv7_chunk(*(t[:37] for t in x))
    y2, s = wkv7_chunk(*(t[37:] for t in x), s)
    assert torch.allclose(torch.cat([y1, y2]), y_all, atol=1e-5 * y_all.abs().max(), rtol=0)
    assert torch.allclose(s, s_all, atol=1e-5 * s_all.abs().max(), rtol=0)


# lengths that cover: shorter than a chunk, exactly one chunk, several chunks with a remainder,
# and a one-token sequence, in an order where the longest is not first
VARLEN = (5, 32, 100, 1, 77, 64, 33, 12)


@pytest.mark.parametrize("N,chunk", [(32, 32), (64, 16), (64, 32)])
def test_batched_call_equals_per_sequence_calls_and_recurrence(N, chunk):
    """One call over a flat batch == one call per sequence (today's loop) == token-by-token recurrence.

    Bound: the chunked form differs from the recurrence by float32 rounding of O(L) products of
    magnitude <= max|y| (measured ~1e-7 relative); 2e-6 * max|y| leaves an order of magnitude. The
    batched call and the per-sequence calls do the same arithmetic per chunk, batched differently,
    so they agree to a few ulps: 1e-6 relative.
    """
    H = 2
    x = _inputs(sum(VARLEN), H, N, seed=N + chunk)
    cu = torch.tensor([0, *torch.tensor(VARLEN).cumsum(0).tolist()])
    g = torch.Generator().manual_seed(7)
    s0 = torch.randn(len(VARLEN), H, N, N, generator=g)
    s0[1] = 0  # a fresh sequence among continued ones
    y_ref, s_ref = wkv7_reference_varlen(*x, s0, cu)
    y, s = wkv7_chunk(*x, s0, cu_seqlens=cu, chunk_size=chunk)
    y_loop = torch.cat(
        [wkv7_chunk(*(t[cu[i] : cu[i + 1]] for t in x), s0[i : i + 1], chunk_size=chunk)[0] for i in range(len(VARLEN))]
    )
    s_loop = torch.cat(
        [wkv7_chunk(*(t[cu[i] : cu[i + 1]] for t in x), s0[i : i + 1], chunk_size=chunk)[1] for i in range(len(VARLEN))]
    )
    assert y.shape == y_ref.shape and s.shape == s0.shape
    assert (y - y_ref).abs().max() <= 2e-6 * y_ref.abs().max()
    assert (s - s_ref).abs().max() <= 2e-6 * s_ref.abs().max()
    assert (y - y_loop).abs().max() <= 1e-6 * y_ref.abs().max()
    assert (s - s_loop).abs().max() <= 1e-6 * s_ref.abs().max()


def test_batched_call_leaves_inputs_alone_and_can_skip_final_state():
    x = _inputs(40, 2, 32, seed=4)
    s0 = torch.randn(2, 2, 32, 32)
    keep = s0.clone()
    y, s = wkv7_chunk(*x, s0, output_final_state=False, cu_seqlens=torch.tensor([0, 9, 40]))
    assert s is None and torch.equal(s0, keep)
    y_zero, _ = wkv7_chunk(*x, None, cu_seqlens=torch.tensor([0, 9, 40]))
    y_ref, _ = wkv7_reference_varlen(*x, torch.zeros(2, 2, 32, 32), [0, 9, 40])
    assert (y_zero - y_ref).abs().max() <= 2e-6 * y_ref.abs().max()


def test_step_keeps_sequences_apart():
    xa, xb = _inputs(5, 2, 32, seed=1), _inputs(5, 2, 32, seed=2)
    s = torch.zeros(2, 2, 32, 32)
    for i in range(5):
        wkv7_step(*(torch.stack([ta[i], tb[i]]) for ta, tb in zip(xa, xb)), s)
    _, sa = wkv7_reference(*xa, torch.zeros(2, 32, 32))
    _, sb = wkv7_reference(*xb, torch.zeros(2, 32, 32))
    assert torch.allclose(s[0], sa, atol=1e-5) and torch.allclose(s[1], sb, atol=1e-5)


def test_ops_are_behind_dispatch():
    ops = dispatch.registered_ops()
    assert ops["rwkv7.wkv_step"]["portable"] and ops["rwkv7.wkv_chunk"]["portable"]
    assert dispatch.op("rwkv7.wkv_chunk").resolve() is wkv7_chunk
    assert dispatch.op("rwkv7.wkv_step").resolve() is wkv7_step
