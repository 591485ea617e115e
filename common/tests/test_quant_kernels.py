"""ModelSlim W8A8 portable kernels against the documented equations (docs/references.md#modelslim-w8a8-math).

The integer accumulator must agree exactly; the float output is compared with the
equation evaluated independently in float64.
"""

from __future__ import annotations

import struct

import pytest

torch = pytest.importorskip("torch")

from ascend_adapters.common import dispatch  # noqa: E402
from ascend_adapters.common.quant.kernels import OPS  # noqa: E402
from ascend_adapters.common.quant.kernels import portable as pk  # noqa: E402
from ascend_adapters.common.quant.linear import decode_deq_scale, encode_deq_scale  # noqa: E402


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _int8(shape, g):
    return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)


def _exact_acc(xq, w):
    return xq.to(torch.int64) @ w.to(torch.int64).t()


@pytest.fixture(params=["int_mm", "fallback"])
def matmul_path(request, monkeypatch):
    monkeypatch.setattr(pk, "_ONEDNN_OK", False)  # the torch paths; the engine's GEMM is tested below
    if request.param == "fallback":
        monkeypatch.setattr(pk, "_INT_MM_OK", False)
    elif not pk._int_mm_available():
        pytest.skip("torch._int_mm not available on this CPU build")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_engine_int8_gemm_matches_exact_integer_reference(dtype, with_bias, monkeypatch):
    """The CPU dynamic linear through vLLM-CPU's own W8A8 path against the exact int64 accumulator.

    On the engine quantizer's int8 activations (checked against ours below) with an exact int32
    accumulator inside oneDNN, the only difference from the equation evaluated in float64 is float32
    rounding of acc * s * ws (a few u32 = 2**-24 relative) and the bias add, then one rounding to dtype:
    |y - ref| <= u(dtype) |ref| + 4 u32 (|ref| + |bias|), the first term being the final rounding of
    the reference itself.

    The engine's quantizer: the same per-token scale s = max|x| / 127 as ours (ModelSlim's), and each
    int8 value round(x * fl(1/s)) where ours is round(fl(x / s)): the first quotient carries at most 2
    float32 roundings (u32 relative each), the second one, so they differ by at most 3 u32 |x / s| and
    may round apart only where x / s lies that close to a .5 boundary (4 u32 |x / s| below), and then
    by one step.
    """
    from ascend_adapters.common import compat

    monkeypatch.setattr(pk, "_ONEDNN_OK", None)
    if compat.cpu_int8_gemm() is None:
        pytest.skip("this engine build has no oneDNN int8 GEMM")
    g = _gen(21)
    t, k, n = 37, 320, 72
    x = (torch.randn(t, k, generator=g) * 3).to(dtype)
    x[5] = 0  # all-zero row: y = bias, never NaN
    w = _int8((n, k), g)
    ws = torch.rand(n, generator=g) * 0.01 + 1e-4
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    y = pk.w8a8_dynamic_linear(x, w, ws, bias)
    assert "_ascend_onednn" in w.__dict__  # the engine's GEMM served it
    xq, s, _ = compat.cpu_int8_gemm().onednn_scaled_int8_quant(x.contiguous())
    ours_q, ours_s = pk.quantize_per_token(x)
    assert torch.equal(s, ours_s)
    apart = xq != ours_q
    quotient = x.double() / torch.where(s > 0, s, torch.ones_like(s)).double()
    near_half = (quotient - quotient.floor() - 0.5).abs() <= 4 * 2.0**-24 * quotient.abs()
    assert ((xq.int() - ours_q.int()).abs() <= 1).all() and not (apart & ~near_half).any()
    ref = _exact_acc(xq, w).double() * s.double() * ws.double()
    b = torch.zeros(n, dtype=torch.float64) if bias is None else bias.double()
    ref = ref + b
    u = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    bound = u * ref.abs() + 4 * 2.0**-24 * (ref.abs() + b.abs()) + 1e-30
    assert ((y.double() - ref).abs() <= bound).all()
    assert torch.isfinite(y).all() and torch.equal(y[5].double(), b.to(dtype).double())


@pytest.mark.parametrize("shape", [(1, 64, 32), (7, 128, 48), (33, 300, 17), (128, 1024, 64)])
def test_int8_matmul_is_exact(shape, matmul_path):
    t, k, n = shape
    g = _gen(t * 31 + k)
    xq, w = _int8((t, k), g), _int8((n, k), g)
    acc = pk.int8_matmul(xq, w)
    assert acc.dtype == torch.int32
    assert torch.equal(acc.to(torch.int64), _exact_acc(xq, w))


def test_int8_matmul_extremes_do_not_overflow(matmul_path):
    k = 4096  # |acc| up to 4096 * 128 * 128 = 2**26: exact in int32, not in float32
    xq = torch.full((3, k), -128, dtype=torch.int8)
    w = torch.full((5, k), -128, dtype=torch.int8)
    w[1] = 127
    acc = pk.int8_matmul(xq, w)
    assert torch.equal(acc.to(torch.int64), _exact_acc(xq, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dynamic_linear_matches_equation(dtype, with_bias, matmul_path):
    g = _gen(1)
    t, k, n = 19, 256, 40
    x = (torch.randn(t, k, generator=g) * 3).to(dtype)
    w = _int8((n, k), g)
    wscale = torch.rand(n, generator=g) * 0.01 + 1e-4
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    y = dispatch.op("modelslim.w8a8_dynamic_linear")(x, w, wscale, bias)
    assert y.dtype == dtype and y.shape == (t, n)
    # The equation, written out: s = max|x| / 127 per token, xq = round(x / s).
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True) / 127.0
    xq = torch.round(xf / s).to(torch.int8)
    q, s_k = pk.quantize_per_token(x)
    assert torch.equal(q, xq) and torch.equal(s_k, s)
    acc = _exact_acc(xq, w)
    assert torch.equal(pk.int8_matmul(q, w).to(torch.int64), acc)
    ref = acc.to(torch.float64) * s.double() * wscale.double()
    if bias is not None:
        ref = ref + bias.double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.double(), ref.to(dtype).double(), rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("offset", [0.0, 6.0, -3.0])
def test_static_linear_matches_equation(offset, matmul_path):
    g = _gen(2)
    t, k, n = 11, 192, 24
    x = torch.randn(t, k, generator=g) * 2
    x[0, 0] = 1e6  # clamps high
    x[1, 1] = -1e6  # clamps low
    w = _int8((n, k), g)
    iscale = torch.tensor([0.02])
    ioff = torch.tensor([offset])
    deq = torch.rand(n, generator=g) * 1e-4 + 1e-6
    qbias = torch.randint(-5000, 5000, (n,), generator=g, dtype=torch.int32)
    y = dispatch.op("modelslim.w8a8_static_linear")(x, w, iscale, ioff, deq, qbias)
    xq = torch.clamp(torch.round(x / 0.02 + offset), -128, 127)
    assert torch.equal(pk.quantize_per_tensor(x, iscale, ioff).to(torch.float32), xq)
    acc = xq.to(torch.int64) @ w.to(torch.int64).t() + qbias.to(torch.int64)
    ref = acc.double() * deq.double()
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
    # Row-parallel rank > 0 does not add quant_bias.
    y0 = dispatch.op("modelslim.w8a8_static_linear")(x, w, iscale, ioff, deq, None)
    ref0 = (acc - qbias.to(torch.int64)).double() * deq.double()
    torch.testing.assert_close(y0.double(), ref0, rtol=1e-6, atol=1e-6 * ref0.abs().max().item())


def test_static_exporter_identity_reproduces_float_linear():
    """quant_bias = round(bias / deq - W.sum(1) * offset) makes the static path approximate x @ Wf.T + bias."""
    from ascend_adapters.testing.modelslim import quantize_weight_per_channel, static_activation_params

    g = _gen(3)
    k, n = 256, 32
    wf = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g) * 0.1
    x = torch.rand(9, k, generator=g) * 3 - 0.5  # asymmetric range -> non-zero offset
    q, wscale = quantize_weight_per_channel(wf)
    iscale, ioff = static_activation_params(float(x.min()), float(x.max()))
    assert ioff != 0
    deq = iscale * wscale.reshape(-1)
    qbias = torch.round(bias / deq - q.double().sum(1).float() * ioff).to(torch.int32)
    y = pk.w8a8_static_linear(x, q, torch.tensor([iscale]), torch.tensor([ioff]), deq, qbias)
    ref = x @ wf.t() + bias
    assert (y - ref).abs().max() < 0.05 * ref.abs().max()


def test_zero_row_gives_bias_never_nan():
    g = _gen(4)
    k, n = 64, 16
    x = torch.randn(4, k, generator=g)
    x[2] = 0
    w = _int8((n, k), g)
    wscale = torch.rand(n, generator=g) * 0.01
    bias = torch.randn(n, generator=g)
    y = pk.w8a8_dynamic_linear(x, w, wscale, bias)
    assert torch.isfinite(y).all()
    assert torch.equal(y[2], bias)
    y_nb = pk.w8a8_dynamic_linear(torch.zeros(3, k), w, wscale, None)
    assert torch.equal(y_nb, torch.zeros(3, n))
    # Static: x = 0 quantizes to the offset; the folded quant_bias then gives back the float bias.
    from ascend_adapters.testing.modelslim import quantize_weight_per_channel

    q, ws = quantize_weight_per_channel(torch.randn(n, k, generator=g) * 0.05)
    iscale, ioff = 0.01, 5.0
    deq = iscale * ws.reshape(-1)
    qbias = torch.round(bias / deq - q.double().sum(1).float() * ioff).to(torch.int32)
    ys = pk.w8a8_static_linear(torch.zeros(1, k), q, torch.tensor([iscale]), torch.tensor([ioff]), deq, qbias)
    assert torch.isfinite(ys).all()
    assert (ys[0] - bias).abs().max() <= deq.max() * 0.5 + 1e-6


def test_deq_scale_bit_pattern_decoding():
    g = _gen(5)
    vals = torch.cat([torch.rand(64, generator=g) * 1e-3, torch.tensor([1.0, -2.5, 3.0e-38, 0.0])])
    enc = encode_deq_scale(vals)
    assert enc.dtype == torch.int64 and (enc >= 0).all() and (enc < 2**32).all()
    # Independent decoding of each int64 with struct: low 32 bits are an IEEE-754 float32.
    for v, e in zip(vals.tolist(), enc.tolist()):
        assert struct.unpack("<f", struct.pack("<I", e & 0xFFFFFFFF))[0] == pytest.approx(v, rel=0, abs=0)
    assert torch.equal(decode_deq_scale(enc), vals)
    # A value msmodelslim wrote for a float32 tiny Llama (down_proj, channel 0).
    assert decode_deq_scale(torch.tensor([936274914], dtype=torch.int64)).item() == pytest.approx(
        struct.unpack("<f", struct.pack("<I", 936274914))[0]
    )
    # Sign-extended encodings (negative int64 with the same low 32 bits) decode the same.
    neg = enc[-3:] - 2**32
    assert torch.equal(decode_deq_scale(neg), vals[-3:])
    # float32 deq_scale passes through.
    assert torch.equal(decode_deq_scale(vals), vals)


# -- MoE ------------------------------------------------------------------------------------------
def _moe_weights(g, e, h, i):
    w13 = _int8((e, 2 * i, h), g)
    w2 = _int8((e, h, i), g)
    s13 = torch.rand(e, 2 * i, generator=g) * 2e-3 + 1e-4
    s2 = torch.rand(e, h, generator=g) * 2e-3 + 1e-4
    return w13, s13, w2, s2


def _loop_reference(x, w13, s13, w2, s2, topk_w, topk_ids, expert_map=None, on_input=False):
    """Token by token, route by route, written from the equations (float64 accumulators)."""

    def dyn(v, w, s):  # one token row
        sc = v.abs().max() / 127.0
        q = torch.round(v / sc) if sc > 0 else torch.zeros_like(v)
        return (q.double() @ w.double().t()) * (sc.double() * s.double())

    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            gid = int(topk_ids[t, j])
            if gid < 0:
                continue
            e = gid if expert_map is None else int(expert_map[gid])
            if e < 0 or e >= w13.shape[0]:
                continue
            wt = float(topk_w[t, j])
            v = x[t].float() * wt if on_input else x[t].float()
            hdn = dyn(v, w13[e], s13[e]).float()
            gate, up = hdn.chunk(2)
            a = torch.nn.functional.silu(gate) * up
            o = dyn(a, w2[e], s2[e])
            out[t] += o if on_input else o * wt
    return out


def _assert_moe_close(y, ref):
    scale = ref.abs().max().item() + 1e-12
    assert (y.double() - ref).abs().max().item() <= 2e-3 * scale, (y.double() - ref).abs().max().item()


def test_moe_matches_per_expert_loop_with_zero_token_experts():
    g = _gen(6)
    e, h, i, t, k = 8, 64, 32, 13, 2
    w13, s13, w2, s2 = _moe_weights(g, e, h, i)
    x = torch.randn(t, h, generator=g)
    ids = torch.randint(0, 4, (t, k), generator=g)  # experts 4..7 receive no tokens
    ids[:, 1] = (ids[:, 0] + 1) % 4
    topk_w = torch.rand(t, k, generator=g)
    y = dispatch.op("modelslim.w8a8_dynamic_moe")(x, w13, s13, w2, s2, topk_w, ids)
    assert torch.bincount(ids.reshape(-1), minlength=e)[4:].sum() == 0
    _assert_moe_close(y, _loop_reference(x, w13, s13, w2, s2, topk_w, ids))


def test_moe_expert_map_non_local_and_negative_routes():
    g = _gen(7)
    e_global, e_local, h, i, t, k = 8, 4, 64, 32, 17, 3
    w13, s13, w2, s2 = _moe_weights(g, e_local, h, i)
    # This rank holds global experts 4..7 as local 0..3 (EP rank 1 of 2).
    expert_map = torch.full((e_global,), -1, dtype=torch.int32)
    expert_map[4:] = torch.arange(4, dtype=torch.int32)
    x = torch.randn(t, h, generator=g)
    ids = torch.randint(0, e_global, (t, k), generator=g)
    ids[0] = torch.tensor([0, 1, 2])  # all routes non-local: row must be exactly zero
    ids[1, 0] = -1  # masked route
    ids[2] = torch.tensor([-1, -1, 5])
    topk_w = torch.rand(t, k, generator=g)
    y = pk.w8a8_dynamic_moe(x, w13, s13, w2, s2, topk_w, ids, expert_map=expert_map)
    assert torch.isfinite(y).all()
    assert torch.equal(y[0], torch.zeros(h))
    _assert_moe_close(y, _loop_reference(x, w13, s13, w2, s2, topk_w, ids, expert_map))


def test_moe_router_weight_on_input_and_empty_batch():
    g = _gen(8)
    w13, s13, w2, s2 = _moe_weights(g, 4, 64, 32)
    x = torch.randn(5, 64, generator=g)
    ids = torch.randint(0, 4, (5, 1), generator=g)
    topk_w = torch.rand(5, 1, generator=g)
    y = pk.w8a8_dynamic_moe(x, w13, s13, w2, s2, topk_w, ids, apply_router_weight_on_input=True)
    _assert_moe_close(y, _loop_reference(x, w13, s13, w2, s2, topk_w, ids, on_input=True))
    empty = pk.w8a8_dynamic_moe(x[:0], w13, s13, w2, s2, topk_w[:0], ids[:0])
    assert empty.shape == (0, 64)


def test_moe_swiglu_limit_clamps_gate_and_up():
    """Clamped SwiGLU (DeepSeek-V4's swiglu_limit): silu(min(gate, L)) * clamp(up, -L, L), from the equations."""
    g = _gen(9)
    e, h, i, t, k, limit = 4, 64, 32, 11, 2, 0.05
    w13, s13, w2, s2 = _moe_weights(g, e, h, i)
    x = torch.randn(t, h, generator=g) * 4
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    topk_w = torch.rand(t, k, generator=g)

    def dyn(v, w, s):
        sc = v.abs().max() / 127.0
        q = torch.round(v / sc) if sc > 0 else torch.zeros_like(v)
        return (q.double() @ w.double().t()) * (sc.double() * s.double())

    ref = torch.zeros(t, h, dtype=torch.float64)
    clamped = 0
    for tok in range(t):
        for j in range(k):
            ex = int(ids[tok, j])
            gate, up = dyn(x[tok].float(), w13[ex], s13[ex]).float().chunk(2)
            clamped += int((gate > limit).sum() + (up.abs() > limit).sum())
            a = torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
            ref[tok] += dyn(a, w2[ex], s2[ex]) * float(topk_w[tok, j])
    assert clamped > 0  # the limit bites on this input
    y = pk.w8a8_dynamic_moe(x, w13, s13, w2, s2, topk_w, ids, swiglu_limit=limit)
    _assert_moe_close(y, ref)
    unclamped = pk.w8a8_dynamic_moe(x, w13, s13, w2, s2, topk_w, ids)
    assert (unclamped.double() - ref).abs().max() > 10 * 2e-3 * ref.abs().max()


def test_kernel_ops_have_portable_and_npu_implementations():
    ops = dispatch.registered_ops()
    for name in OPS:
        assert ops[name] == {"portable": True, "npu": True}, name
