"""The chunked and step forms of the WKV-7 recurrence against the plain reference."""

from __future__ import annotations

import pytest
import torch

from ascend_adapters.common import dispatch
from ascend_adapters.rwkv7.kernels import wkv7_chunk, wkv7_reference, wkv7_step


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

    s = s0.clone()
    y = wkv7_chunk(*x, s, chunk_size=chunk)
    assert (y - y_ref).abs().max() <= 2e-6 * scale
    assert (s - s_ref).abs().max() <= 2e-6 * s_ref.abs().max()

    s = s0.clone()[None].contiguous()
    ys = torch.stack([wkv7_step(*(t[i : i + 1] for t in x), s)[0] for i in range(T)])
    assert (ys - y_ref).abs().max() <= 2e-6 * scale
    assert (s[0] - s_ref).abs().max() <= 2e-6 * s_ref.abs().max()


def test_chunk_continues_from_state():
    """Two chunked calls (prompt split as chunked prefill does) == one call."""
    x = _inputs(90, 2, 64, seed=3)
    s_all = torch.zeros(2, 64, 64)
    y_all = wkv7_chunk(*x, s_all)
    s = torch.zeros(2, 64, 64)
    y1 = wkv7_chunk(*(t[:37] for t in x), s)
    y2 = wkv7_chunk(*(t[37:] for t in x), s)
    assert torch.allclose(torch.cat([y1, y2]), y_all, atol=1e-5 * y_all.abs().max(), rtol=0)
    assert torch.allclose(s, s_all, atol=1e-5 * s_all.abs().max(), rtol=0)


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
