"""The NPU kernel path on CPU, through the torch_npu CONTRACT EMULATOR (not an NPU run).

``ascend_adapters.testing.npu_emulator`` refuses every call torch_npu's documentation does not
allow and otherwise computes the documented formula. Here it stands in for ``torch_npu`` so that:

* each contract rule the NPU path depends on is shown to fire (the emulator is not a pass-through);
* every op registered with ``dispatch.npu`` runs against its portable twin in float16 and bfloat16;
* the fixes of issue 12 hold: bfloat16 MoE scales, one local expert, float32 activations, outputs wider
  than 65535, the path chosen from the tensor's device, and no float64 in the portable int8 matmul;
* the experts' routing on the device (``npu_moe_init_routing_v2``, ``npu_moe_token_unpermute``) keeps
  expert maps, negative ids and experts with no token (test_experts_capture.py: no host read, one op
  sequence).
"""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")

from ascend_adapters.common import dispatch, platform  # noqa: E402
from ascend_adapters.common.platform import KernelPath  # noqa: E402
from ascend_adapters.common.quant.kernels import portable as pk  # noqa: E402
from ascend_adapters.testing import npu_emulator as emu  # noqa: E402
from ascend_adapters.testing.npu_emulator import NpuContractError  # noqa: E402

# Unit roundoff u (half an ulp at 1.0) of each output dtype.
U = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


@pytest.fixture
def emulated(monkeypatch):
    """torch_npu = the emulator, and CPU tensors take the NPU implementations."""
    monkeypatch.setitem(sys.modules, "torch_npu", emu.as_module())
    monkeypatch.setenv(platform.EMULATOR_ENV, "1")
    monkeypatch.delenv(platform.FORCE_PORTABLE_ENV, raising=False)
    platform.reset()
    yield
    platform.reset()


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _int8(shape, g):
    return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)


def _npu(name):
    return dispatch.op(name).resolve(KernelPath.NPU)


def _port(name):
    return dispatch.op(name).resolve(KernelPath.PORTABLE)


# -- the emulator refuses what the documentation does not allow -------------------------------------
def test_emulator_enforces_documented_contracts():
    g = _g(0)
    x32 = torch.randn(4, 8, generator=g)
    with pytest.raises(NpuContractError, match="float16/bfloat16 only"):
        emu.npu_dynamic_quant(x32)
    with pytest.raises(NpuContractError, match="more than 1 dimension"):
        emu.npu_dynamic_quant(torch.randn(8).half())
    xq, w = _int8((2, 16), g), _int8((16, 8), g)
    one = torch.ones(8)
    with pytest.raises(NpuContractError, match="output_dtype"):
        emu.npu_quant_matmul(xq, w, one, output_dtype=torch.float32)
    with pytest.raises(NpuContractError, match="exceeds 65535"):
        emu.npu_quant_matmul(xq, _int8((16, 65536), g), torch.ones(65536), output_dtype=torch.bfloat16)
    with pytest.raises(NpuContractError, match="not in the table"):  # bf16 scale with fp16 output
        emu.npu_quant_matmul(xq, w, one.bfloat16(), pertoken_scale=torch.ones(2), output_dtype=torch.float16)
    assert emu.npu_quant_matmul(xq, w, one, pertoken_scale=torch.ones(2), output_dtype=torch.float16).dtype == (
        torch.float16
    )
    gx, gw = _int8((5, 16), g), _int8((2, 16, 8), g)
    kw = dict(per_token_scale=[torch.ones(5)], split_item=2, group_type=0, group_list=torch.tensor([2, 5]))
    with pytest.raises(NpuContractError, match="scale torch.float32, per_token_scale True, output torch.bfloat16"):
        emu.npu_grouped_matmul([gx], [gw], scale=[torch.ones(2, 8)], output_dtype=torch.bfloat16, **kw)
    with pytest.raises(NpuContractError, match="scale torch.bfloat16, per_token_scale True, output torch.float16"):
        emu.npu_grouped_matmul([gx], [gw], scale=[torch.ones(2, 8).bfloat16()], output_dtype=torch.float16, **kw)
    ok = emu.npu_grouped_matmul([gx], [gw], scale=[torch.ones(2, 8).bfloat16()], output_dtype=torch.bfloat16, **kw)
    assert ok[0].dtype == torch.bfloat16
    one_expert = dict(kw, group_list=torch.tensor([5]), group_list_type=1)
    with pytest.raises(NpuContractError, match="may not have length 1"):
        emu.npu_grouped_matmul([gx], [gw[:1]], scale=[torch.ones(1, 8)], output_dtype=torch.float16, **one_expert)
    with pytest.raises(NpuContractError, match="non-decreasing"):
        emu.npu_grouped_matmul(
            [gx],
            [gw],
            scale=[torch.ones(2, 8)],
            output_dtype=torch.float16,
            **dict(kw, group_list=torch.tensor([3, 2])),
        )
    with pytest.raises(NpuContractError, match="must match scales"):
        emu.npu_quantize(x32, torch.ones(1), torch.ones(1).half(), torch.qint8, -1, False)


def test_emulator_enforces_the_float_and_clipped_swiglu_contracts():
    g = _g(2)
    x, w = torch.randn(5, 16, generator=g).bfloat16(), torch.randn(2, 16, 8, generator=g).bfloat16()
    kw = dict(split_item=2, group_type=0, group_list=torch.tensor([2, 5]))
    with pytest.raises(NpuContractError, match="x torch.bfloat16 with weight torch.float16"):
        emu.npu_grouped_matmul([x], [w.half()], **kw)
    with pytest.raises(NpuContractError, match="output torch.float32 for x torch.bfloat16"):
        emu.npu_grouped_matmul([x], [w], output_dtype=torch.float32, **kw)
    with pytest.raises(NpuContractError, match="x must not be a transposed view"):
        emu.npu_grouped_matmul([x.t().contiguous().t()], [w], **kw)
    with pytest.raises(NpuContractError, match="last value 4 != rows of x 5"):
        emu.npu_grouped_matmul([x], [w], **dict(kw, group_list=torch.tensor([2, 4])))
    y = emu.npu_grouped_matmul([x], [w], **kw)[0]
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y[2:], (x[2:].float() @ w[1].float()).bfloat16())
    h = torch.randn(4, 10, generator=g) * 5
    with pytest.raises(NpuContractError, match="non-contiguous"):
        emu.npu_clipped_swiglu(h.t().contiguous().t())
    with pytest.raises(NpuContractError, match="is odd"):
        emu.npu_clipped_swiglu(h[:, :9].contiguous())
    with pytest.raises(NpuContractError, match="rank 1"):
        emu.npu_clipped_swiglu(h[0].contiguous())
    # 功能说明: A.clamp(max=limit) * sigmoid(alpha A) * (B.clamp(-limit, limit) + bias), front/back halves
    a, b = h.chunk(2, -1)
    want = a.clamp(max=2.0) * torch.sigmoid(a.clamp(max=2.0)) * b.clamp(-2.0, 2.0)
    got = emu.npu_clipped_swiglu(h, alpha=1.0, limit=2.0, bias=0.0, interleaved=False)
    torch.testing.assert_close(got, want)


def test_emulator_enforces_the_moe_routing_and_unpermute_contracts():
    g = _g(3)
    x = torch.randn(4, 8, generator=g).bfloat16()
    ids = torch.tensor([[0, 2], [1, 1], [2, 0], [3, 1]], dtype=torch.int32)
    kw = dict(active_num=8, expert_num=4, expert_tokens_num_type=0, expert_tokens_num_flag=True)
    with pytest.raises(NpuContractError, match="expert_idx"):
        emu.npu_moe_init_routing_v2(x, ids.long(), **kw)  # 参数说明 expert_idx: int32
    with pytest.raises(NpuContractError, match="an expert id >= expert_num"):
        emu.npu_moe_init_routing_v2(x, ids, **dict(kw, expert_num=3, active_expert_range=[0, 3]))
    with pytest.raises(NpuContractError, match="active_expert_range"):
        emu.npu_moe_init_routing_v2(x, ids, **dict(kw, active_expert_range=[0, 5]))
    with pytest.raises(NpuContractError, match="expert_num"):
        emu.npu_moe_init_routing_v2(x, ids, **dict(kw, expert_num=10241))
    y = torch.randn(8, 8, generator=g).bfloat16()
    perm = torch.randperm(8, generator=g).to(torch.int32)
    probs = torch.rand(4, 2, generator=g).bfloat16()
    with pytest.raises(NpuContractError, match="sortedIndices"):
        emu.npu_moe_token_unpermute(y, perm.long(), probs=probs)  # aclnnMoeTokenUnpermute: INT32
    with pytest.raises(NpuContractError, match="repeated indices"):
        emu.npu_moe_token_unpermute(y, torch.zeros(8, dtype=torch.int32), probs=probs)
    with pytest.raises(NpuContractError, match="outside"):
        emu.npu_moe_token_unpermute(y, perm - 1, probs=probs)  # the -1 of an inactive route
    with pytest.raises(NpuContractError, match="rows for"):
        emu.npu_moe_token_unpermute(y[:6], perm[:6], probs=probs)
    with pytest.raises(NpuContractError, match="paddedMode"):
        emu.npu_moe_token_unpermute(y, perm, probs=probs, padded_mode=True)


def test_emulator_moe_routing_and_unpermute_follow_the_documented_formulas():
    """npu_moe_init_routing_v2 功能说明 1-6 and aclnnMoeTokenUnpermute's 功能说明, written out here."""
    g = _g(4)
    x = torch.randn(5, 6, generator=g)
    ids = torch.tensor([[3, 0], [1, 3], [0, 0], [2, 4], [4, 1]], dtype=torch.int32)
    flat = ids.reshape(-1).tolist()
    for rng in ([0, 5], [1, 4]):
        kw = dict(expert_num=5, expert_tokens_num_flag=True, active_expert_range=rng)
        ex, row_idx, cum, _ = emu.npu_moe_init_routing_v2(x, ids, active_num=10, expert_tokens_num_type=0, **kw)
        _, scatter_idx, counts, _ = emu.npu_moe_init_routing_v2(x, ids, expert_tokens_num_type=1, row_idx_type=1, **kw)
        # stable sort of the active routes by expert: (expert, flat index) pairs in order
        active = sorted((e, j) for j, e in enumerate(flat) if rng[0] <= e < rng[1])
        n = len(active)
        assert ex.shape == (10, 6) and row_idx.dtype == torch.int32 and cum.dtype == torch.int64
        assert torch.equal(ex[:n], torch.stack([x[j // 2] for _, j in active]))
        assert bool(ex[n:].isnan().all())  # rows past the available ones: not described, NaN here
        want_gather = [-1] * 10
        for i, (_, j) in enumerate(active):
            want_gather[j] = i
        assert row_idx.tolist() == want_gather
        assert scatter_idx[:n].tolist() == [j for _, j in active]
        want_counts = [sum(1 for e, _ in active if e == ex_id) for ex_id in range(rng[0], rng[1])]
        assert counts.tolist() == want_counts and cum.tolist() == torch.tensor(want_counts).cumsum(0).tolist()
    # unpermute: O[i] = sum_j P[i][j] * T[S[i*topK + j]]
    t = torch.randn(10, 6, generator=g)
    s = torch.randperm(10, generator=g).to(torch.int32)
    p = torch.rand(5, 2, generator=g)
    out = emu.npu_moe_token_unpermute(t, s, probs=p)
    want = torch.stack([sum(p[i, j] * t[int(s[2 * i + j])] for j in range(2)) for i in range(5)])
    torch.testing.assert_close(out, want, rtol=2 * U[torch.float32], atol=1e-7)


def test_emulator_math_matches_the_documented_formulas():
    g = _g(1)
    x = (torch.randn(6, 32, generator=g) * 4).bfloat16()
    y, s = emu.npu_dynamic_quant(x)
    assert y.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (6,)
    assert torch.equal(s, x.float().abs().amax(-1) / 127)
    assert torch.equal(y, torch.round(x.float() / s[:, None]).to(torch.int8))
    xq, w = _int8((3, 40), g), _int8((40, 7), g)
    acc = emu.npu_quant_matmul(xq, w, torch.ones(7), output_dtype=torch.int32)
    assert torch.equal(acc.long(), xq.long() @ w.long())
    h = torch.randn(4, 10, generator=g)
    a, b = h.chunk(2, -1)
    torch.testing.assert_close(emu.npu_swiglu(h), torch.nn.functional.silu(a) * b)


# -- every dispatch.npu op against its portable twin in float16 and bfloat16 -------------------------
def _case_pack_weight(dtype, g):
    w = _int8((3, 24, 40), g)
    packed = _npu("modelslim.pack_weight")(w)
    assert packed.shape == (3, 40, 24) and torch.equal(packed, w.transpose(-1, -2))
    assert torch.equal(_port("modelslim.pack_weight")(w), w)


def _case_pack_input_quant(dtype, g):
    # npu_quantize's scales in the input's dtype (1 / scale: it multiplies); the portable path divides in float32
    scale, off = torch.rand(1, generator=g) * 0.1 + 1e-3, torch.tensor([-7.0])
    npu_scale, npu_off = _npu("modelslim.pack_input_quant")(scale, off, dtype)
    assert npu_scale.dtype == npu_off.dtype == dtype and npu_scale.shape == npu_off.shape == (1,)
    assert torch.equal(npu_scale, (1 / scale).to(dtype)) and torch.equal(npu_off, off.to(dtype))
    port = _port("modelslim.pack_input_quant")(scale, off, dtype)
    assert port[0] is scale and port[1] is off


def _case_pack_moe_scale(dtype, g):
    # npu_grouped_matmul per-token: bfloat16 scales for bfloat16 (and float32, run in bfloat16), float32 for float16
    s = torch.rand(4, 24, generator=g) * 1e-2
    want = torch.float32 if dtype == torch.float16 else torch.bfloat16
    for act in (dtype, torch.float32):
        packed = _npu("modelslim.pack_moe_scale")(s, act)
        assert packed.dtype == (want if act == dtype else torch.bfloat16) and torch.equal(packed, s.to(packed.dtype))
    assert _port("modelslim.pack_moe_scale")(s, dtype) is s


def _dynamic_bound(ref, bias, dtype):
    # On the same int8 activations the integer accumulators agree exactly. The portable side rounds
    # acc * s * ws to float32 then once to dtype; the NPU side rounds once to dtype and adds the bias in
    # dtype (a second rounding). Two roundings of relative size u plus float32 noise: |npu - portable| <=
    # 2u (|y| + |bias|) + 4u |y| (the second rounding of a value already within u), plus the smallest
    # subnormal for values near zero.
    b = 0 if bias is None else bias.double().abs()
    return 6 * U[dtype] * (ref.double().abs() + b) + 2.0**-24


def _case_dynamic_linear(dtype, g, n=40, k=256, with_bias=True):
    x = (torch.randn(2, 9, k, generator=g) * 3).to(dtype)
    w = _int8((n, k), g)
    ws = torch.rand(n, generator=g) * 0.01 + 1e-4
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    y = _npu("modelslim.w8a8_dynamic_linear")(x, _npu("modelslim.pack_weight")(w), ws, bias)
    ref = _port("modelslim.w8a8_dynamic_linear")(x, w, ws, bias)
    assert y.dtype == dtype and y.shape == ref.shape
    # both sides quantize with the equation's quantizer (the portable op is the torch path): the same int8 values
    bound = _dynamic_bound(ref, bias, dtype)
    assert ((y.double() - ref.double()).abs() <= bound).all()
    return y, ref


def _case_static_linear(dtype, g, n=24, k=192):
    x = (torch.randn(11, k, generator=g) * 2).to(dtype)
    w = _int8((n, k), g)
    iscale, ioff = torch.tensor([0.02]), torch.tensor([3.0])
    deq = torch.rand(n, generator=g) * 1e-4 + 1e-6
    qb = torch.randint(-5000, 5000, (n,), generator=g, dtype=torch.int32)
    npu_scale, npu_off = _npu("modelslim.pack_input_quant")(iscale, ioff, dtype)
    y = _npu("modelslim.w8a8_static_linear")(x, _npu("modelslim.pack_weight")(w), npu_scale, npu_off, deq, qb)
    ref = _port("modelslim.w8a8_static_linear")(
        x, w, *_port("modelslim.pack_input_quant")(iscale, ioff, dtype), deq, qb
    )
    # The NPU path multiplies by 1/input_scale rounded to x's dtype (npu_quantize takes scales in the
    # input's dtype), the portable path divides in float32: individual int8 activations may differ by one
    # step. Each differing step moves acc[t, n] by |w[n, k]|, so the exact bound on the accumulator is
    # |dxq| @ |w|.T; after scaling, deq[n] times that, plus two roundings to dtype of relative size u.
    xq_npu = emu.npu_quantize(x, (1 / iscale).to(dtype), ioff.to(dtype), torch.qint8, -1, False)
    dxq = (xq_npu.long() - pk.quantize_per_tensor(x, iscale, ioff).long()).abs()
    assert dxq.max() <= 1
    bound = (dxq.double() @ w.double().abs().t()) * deq.double() + 4 * U[dtype] * ref.double().abs() + 2.0**-24
    assert ((y.double() - ref.double()).abs() <= bound).all()
    return y, ref


def _moe_inputs(g, e, h, i, t, k):
    w13, w2 = _int8((e, 2 * i, h), g), _int8((e, h, i), g)
    s13 = torch.rand(e, 2 * i, generator=g) * 2e-3 + 1e-4
    s2 = torch.rand(e, h, generator=g) * 2e-3 + 1e-4
    ids = torch.randint(0, e, (t, k), generator=g)
    topk_w = torch.rand(t, k, generator=g)
    return w13, s13, w2, s2, topk_w, ids


def _moe_bound(dtype):
    # Normwise relative difference of two implementations of the same quantized MoE: each side's error
    # against exact arithmetic is at most the int8 activation step of the intermediate (half of 1/127 of
    # the row max, relative), the scale rounding (bfloat16 scales on the NPU path: u = 2**-8 for bf16;
    # float32 for fp16) and the output rounding (u of dtype) twice (hidden and output); the difference
    # of the two is at most the sum of both sides' errors.
    scale_u = U[torch.bfloat16] if dtype in (torch.bfloat16, torch.float32) else U[torch.float32]
    out_u = U[torch.bfloat16] if dtype == torch.float32 else U[dtype]
    return 2 * (0.5 / 127 + scale_u + 2 * out_u)


def _case_moe(dtype, g, e=4, h=64, i=32, t=13, k=2, swiglu_limit=None):
    w13, s13, w2, s2, topk_w, ids = _moe_inputs(g, e, h, i, t, k)
    x = torch.randn(t, h, generator=g).to(dtype)
    pack, scales = _npu("modelslim.pack_weight"), _npu("modelslim.pack_moe_scale")
    kw = {"swiglu_limit": swiglu_limit}
    y = _npu("modelslim.w8a8_dynamic_moe")(
        x, pack(w13), scales(s13, dtype), pack(w2), scales(s2, dtype), topk_w, ids, **kw
    )
    ref = _port("modelslim.w8a8_dynamic_moe")(x, w13, s13, w2, s2, topk_w, ids, **kw)
    assert y.dtype == dtype and y.shape == (t, h)
    rel = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    assert rel <= _moe_bound(dtype), rel
    return y, ref


def _case_rope(dtype, g):
    # GLM-DSA's form (the whole rope slice, [T, H, R]) and DeepSeek-V4's (trailing rope of [T, H, D],
    # and 2-D [T, D]); more heads than npu_rotary_mul's B*N < 1000 allows in one call.
    for shape in ((5, 4, 64), (5, 3, 96), (5, 64), (2, 1200, 64)):
        t, r = shape[0], 64
        x = torch.randn(*shape, generator=g).to(dtype)
        ang = torch.rand(t, r // 2, generator=g) * 6.28
        cos, sin = ang.cos(), ang.sin()
        y = _npu("common.rope_interleaved")(x, cos, sin)
        ref = _port("common.rope_interleaved")(x, cos, sin)
        assert torch.equal(y[..., :-r], x[..., :-r])
        # The NPU form rounds cos/sin to x's dtype (relative u each) before x*cos + rot(x)*sin; each output
        # pair element is x_a cos - x_b sin, so the difference is at most u (|x_a| + |x_b|) + 2u |y|.
        xa, xb = x[..., -r:].double()[..., 0::2], x[..., -r:].double()[..., 1::2]
        pair = (xa.abs() + xb.abs()).repeat_interleave(2, -1)
        diff = (y[..., -r:].double() - ref[..., -r:].double()).abs()
        assert (diff <= U[dtype] * pair + 2 * U[dtype] * ref[..., -r:].double().abs() + 1e-6).all()
    # A table scaled past 1 (YaRN's attention factor m = 1.25): divided by m for the [-1, 1] rule, multiplied
    # back: one more rounding of the product by m (u |y|) and of cos/m, sin/m (u each, as above).
    x = torch.randn(5, 4, 64, generator=g).to(dtype)
    ang = torch.rand(5, 32, generator=g) * 6.28
    cos, sin = ang.cos() * 1.25, ang.sin() * 1.25
    y, ref = _npu("common.rope_interleaved")(x, cos, sin), _port("common.rope_interleaved")(x, cos, sin)
    pair = (x.double()[..., 0::2].abs() + x.double()[..., 1::2].abs()).repeat_interleave(2, -1) * 1.25
    assert ((y.double() - ref.double()).abs() <= 2 * U[dtype] * pair + 3 * U[dtype] * ref.double().abs() + 1e-6).all()


def _case_swiglu(dtype, g):
    h = (torch.randn(9, 2, 48, generator=g) * 4).to(dtype)
    for limit in (None, 1.5):
        y = _npu("common.swiglu")(h, limit)
        ref = _port("common.swiglu")(h, limit)
        assert y.dtype == dtype and y.shape == ref.shape
        # NPU (emulated op: float32 math, one rounding) against torch in dtype (silu rounded to dtype, then
        # the product rounded): at most two roundings of relative u apart, plus float32 noise.
        assert ((y.double() - ref.double()).abs() <= 3 * U[dtype] * ref.double().abs() + 1e-6).all()


def _case_swiglu_experts(dtype, g, e=4, h=48, i=32, t=13, k=2):
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    ids = torch.randint(0, e, (t, k), generator=g)
    wts = torch.rand(t, k, generator=g)
    for limit in (None, 1.0):
        y = _npu("common.swiglu_experts")(x, w13, w2, wts, ids, limit=limit)
        ref = _port("common.swiglu_experts")(x, w13, w2, wts, ids, limit=limit)
        assert y.dtype == dtype and y.shape == (t, h)
        # Both sides round the hidden and the output to dtype and sum k routes in dtype; they differ in the
        # order of the float32 accumulation (emulated matmul) against torch's, and in the SwiGLU's rounding:
        # normwise, each side is within (2 + 3 + k) u of the exact result (two matmul roundings, the
        # SwiGLU's three, k additions), so the two within twice that.
        rel = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
        assert rel <= 2 * (2 + 3 + k) * U[dtype], rel


def _case_glm_cache_rows(dtype, g):
    from ascend_adapters.glm_dsa import kernels as glm  # noqa: F401  (registers glm_dsa.cache_rows)

    cache = torch.randn(6, 4, 40, generator=g).to(dtype)
    slots = torch.randint(0, 24, (3, 5, 7), generator=g)
    slots[0, 0, 0] = 0  # so that slots - 1 below holds a negative index
    y = _npu("glm_dsa.cache_rows")(cache, slots)
    # a gather copies rows: equal to the portable form bit for bit
    assert torch.equal(y, _port("glm_dsa.cache_rows")(cache, slots))
    with pytest.raises(NpuContractError, match="no negative indices"):
        _npu("glm_dsa.cache_rows")(cache, slots - 1)


def _case_kv8_int8(dtype, g):
    from ascend_adapters.common.kernels import kv8  # noqa: F401  (registers common.kv8_int8_quantize)

    parts = (32, 16, 24)  # GLM-DSA's kv_c | k_pe | indexer key, at tiny widths
    x = torch.randn(3, 5, sum(parts), generator=g)
    x[..., 32:48] *= 40.0
    # npu_dynamic_quant per part (the emulator refuses any call its page does not allow); the codes and scales
    # are the documented formula's, as the portable kernel's, bit for bit; a float32 row is rounded to
    # bfloat16 first by both (the op's input dtypes)
    for rows in (x.to(dtype), x):
        assert torch.equal(
            _npu("common.kv8_int8_quantize")(rows, parts), _port("common.kv8_int8_quantize")(rows, parts)
        )


TWINS = {
    "modelslim.pack_weight": _case_pack_weight,
    "modelslim.pack_input_quant": _case_pack_input_quant,
    "modelslim.pack_moe_scale": _case_pack_moe_scale,
    "modelslim.w8a8_dynamic_linear": _case_dynamic_linear,
    "modelslim.w8a8_static_linear": _case_static_linear,
    "modelslim.w8a8_dynamic_moe": _case_moe,
    "common.rope_interleaved": _case_rope,
    "common.swiglu": _case_swiglu,
    "common.swiglu_experts": _case_swiglu_experts,
    "glm_dsa.cache_rows": _case_glm_cache_rows,
    "common.kv8_int8_quantize": _case_kv8_int8,
}


def _all_npu_ops():
    # Import every module that registers kernels on this branch, so a new dispatch.npu op is seen here.
    import ascend_adapters.common.kernels  # noqa: F401
    import ascend_adapters.common.quant.kernels  # noqa: F401

    for mod in (
        "ascend_adapters.glm_dsa.kernels",
        "ascend_adapters.deepseek_v4.kernels",
        "ascend_adapters.rwkv7.kernels",
    ):
        __import__(mod)
    return sorted(n for n, impl in dispatch.registered_ops().items() if impl["npu"] and not n.startswith("test."))


def test_every_npu_op_has_a_twin_test():
    missing = set(_all_npu_ops()) - set(TWINS)
    assert not missing, f"dispatch.npu ops without an emulated twin test: {sorted(missing)}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(TWINS))
def test_npu_op_matches_portable_twin(name, dtype, emulated):
    TWINS[name](dtype, _g(hash(name) % 1000))


# -- the fixes of issue 12 ---------------------------------------------------------------------------
def test_moe_single_local_expert(emulated):
    """group_list_type=1 with one expert is documented invalid: the NPU path must not use it then."""
    _case_moe(torch.bfloat16, _g(11), e=1, k=1)


def test_moe_clamped_swiglu_takes_npu_clipped_swiglu(emulated, monkeypatch):
    """DeepSeek-V4's clamped SwiGLU in the W8A8 experts: npu_clipped_swiglu, within the MoE bound."""
    called = []
    monkeypatch.setattr(emu, "_trace", called.append)
    monkeypatch.setitem(sys.modules, "torch_npu", emu.as_module())
    # limit 0.05: below the hidden's typical magnitude here, so the clamps act on most elements
    _case_moe(torch.bfloat16, _g(15), swiglu_limit=0.05)
    assert "npu_clipped_swiglu" in called and "npu_swiglu" not in called


def test_float32_activations_take_a_documented_route(emulated):
    g = _g(12)
    # Linears: exact int32 accumulators from npu_quant_matmul, scaled in float32 -> equal to portable up
    # to float32 rounding of the same products (the dynamic case asserts its bound inside, with u32).
    _case_dynamic_linear(torch.float32, g)
    y, ref = _case_static_linear(torch.float32, g)
    torch.testing.assert_close(y, ref, rtol=4 * U[torch.float32], atol=2.0**-24)
    _case_moe(torch.float32, g)


def test_output_wider_than_65535_is_split(emulated):
    # DeepSeek-V4's q_b_proj is 128 heads x 512 = 65536 wide: past npu_quant_matmul's 65535 cap.
    g = _g(13)
    for dtype in (torch.bfloat16, torch.float16):
        _case_dynamic_linear(dtype, g, n=65536 + 7, k=16, with_bias=False)
        _case_static_linear(dtype, g, n=65536 + 7, k=16)


def _routing(case, g, t, k, e):
    """``(ids, expert_map)`` of a routing that stresses the NPU routing: another rank's experts (an
    interleaved placement) and negative ids, experts with no token (the last one too), one expert."""
    ids = torch.randint(0, e, (t, k), generator=g)
    if case == "expert_map":
        emap = torch.full((2 * e,), -1, dtype=torch.int32)
        emap[1::2] = torch.arange(e, dtype=torch.int32)  # global 1, 3, 5, ... are this rank's 0, 1, 2, ...
        ids = torch.randint(0, 2 * e, (t, k), generator=g)
        ids[0] = 0  # every route elsewhere: exactly zero
        ids[1, 0] = -1
        return ids, emap
    if case == "idle_experts":
        ids = ids % 2  # experts 0 and 1 only: the last one idle
        ids[2, 1] = -1
    elif case == "one_expert":
        ids = torch.full_like(ids, e - 1)
    return ids, None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", ["expert_map", "idle_experts", "one_expert", "one_token"])
def test_npu_swiglu_experts_within_the_reference_bound(case, dtype, emulated):
    """The emulated NPU float experts against the float64 route-by-route reference. Each route's term is two
    grouped matmuls of depth K (float32 products and sums, |error| <= K u32 |a||b|, then one rounding to
    dtype, u), the SwiGLU (float32, one rounding: u) and, in npu_moe_token_unpermute, the weight rounded
    to dtype (u) and a float32 sum of k products rounded once (u): within test_common_kernels' bound
    (2 max(H, I) + 8 + 2 + k) u, normwise."""
    from ascend_adapters.common.kernels import experts

    g = _g(21)
    e, h, i, t, k = 4, 48, 32, 13, 2
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    ids, emap = _routing(case, g, t, k, e)
    wts = torch.rand(t, k, generator=g)
    if case == "one_token":
        x, ids, wts = x[:1], ids[:1], wts[:1]
    y = _npu("common.swiglu_experts")(x, w13, w2, wts, ids, expert_map=emap, limit=1.0)
    assert y.dtype == dtype and y.shape == x.shape
    ref = experts.grouped_experts_reference(x, wts, ids, experts.swiglu_expert_reference(w13, w2, 1.0), expert_map=emap)
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert rel <= (2 * max(h, i) + 8 + 2 + k) * U[dtype], rel
    if dtype != torch.float32:  # and within _case_swiglu_experts' bound of the portable twin
        port = _port("common.swiglu_experts")(x, w13, w2, wts, ids, expert_map=emap, limit=1.0)
        twin = ((y.double() - port.double()).norm() / port.double().norm()).item()
        assert twin <= 2 * (2 + 3 + k) * U[dtype], twin
    if case == "expert_map":
        assert torch.equal(y[0], torch.zeros_like(y[0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", ["expert_map", "idle_experts", "one_expert", "weight_on_input"])
def test_npu_moe_routings_match_portable(case, dtype, emulated):
    """The emulated NPU W8A8 experts against the portable ones (which test_quant_kernels checks route by
    route) for the routings above and router weights on the input (k = 2: each route's row scaled before
    its quantization), within _moe_bound."""
    g = _g(22)
    e, h, i, t, k = 4, 64, 32, 13, 2
    w13, s13, w2, s2, topk_w, _ = _moe_inputs(g, e, h, i, t, k)
    ids, emap = _routing(case, g, t, k, e)
    x = torch.randn(t, h, generator=g).to(dtype)
    kw = {"expert_map": emap, "apply_router_weight_on_input": case == "weight_on_input"}
    pack, scales = _npu("modelslim.pack_weight"), _npu("modelslim.pack_moe_scale")
    y = _npu("modelslim.w8a8_dynamic_moe")(
        x, pack(w13), scales(s13, dtype), pack(w2), scales(s2, dtype), topk_w, ids, **kw
    )
    ref = _port("modelslim.w8a8_dynamic_moe")(x, w13, s13, w2, s2, topk_w, ids, **kw)
    assert y.dtype == dtype and y.shape == (t, h)
    rel = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    assert rel <= _moe_bound(dtype), rel
    if case == "expert_map":
        assert torch.equal(y[0], torch.zeros_like(y[0]))


def test_kernel_path_follows_the_tensor_device(monkeypatch):
    """A CPU tensor takes the portable path even where torch_npu imports and reports an NPU."""
    monkeypatch.setitem(sys.modules, "torch_npu", emu.as_module())
    monkeypatch.delenv(platform.EMULATOR_ENV, raising=False)
    monkeypatch.delenv(platform.FORCE_PORTABLE_ENV, raising=False)
    monkeypatch.setattr(platform, "npu_available", lambda: (True, "pretend one NPU"))
    platform.reset()
    try:
        assert platform.path_for_device("cpu") is KernelPath.PORTABLE
        assert platform.path_for_device("npu") is KernelPath.NPU
        g = _g(14)
        x, w, ws = torch.randn(3, 32, generator=g), _int8((8, 32), g), torch.rand(8, generator=g)
        # The portable kernel takes the [N, K] checkpoint layout; the NPU one would refuse it as [K, N].
        y = dispatch.op("modelslim.w8a8_dynamic_linear")(x, dispatch.op("modelslim.pack_weight")(w), ws)
        torch.testing.assert_close(y, pk.w8a8_dynamic_linear(x, w, ws))
        monkeypatch.setenv(platform.FORCE_PORTABLE_ENV, "1")
        platform.reset()
        assert platform.path_for_device("npu") is KernelPath.PORTABLE
    finally:
        platform.reset()


def test_emulator_env_refused_without_the_emulator(monkeypatch):
    monkeypatch.setenv(platform.EMULATOR_ENV, "1")
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu -> ImportError
    platform.reset()
    try:
        with pytest.raises(RuntimeError, match="no torch_npu emulator is installed"):
            platform.path_for_device("cpu")
    finally:
        platform.reset()


def test_portable_int8_matmul_uses_no_float64(monkeypatch):
    """Ascend devices have no float64: the fallback (no torch._int_mm) must stay exact without it."""
    from torch.overrides import TorchFunctionMode

    seen = set()

    class Dtypes(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for v in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(v, torch.Tensor):
                    seen.add(v.dtype)
            return out

    monkeypatch.setattr(pk, "_INT_MM_OK", False)
    k = 4096  # |acc| up to 2**26: beyond float32's exact integers, so one float32 matmul would not do
    xq = torch.full((3, k), -128, dtype=torch.int8)
    w = torch.full((5, k), -128, dtype=torch.int8)
    w[1] = 127
    w[2, ::3] = 5
    with Dtypes():
        acc = pk.int8_matmul(xq, w)
    assert torch.float64 not in seen
    assert torch.equal(acc.long(), xq.long() @ w.long().t())


def test_static_linear_op_traces_the_npu_layout_under_torch_compile(emulated):
    """The static W8A8 op is opaque to vLLM's torch.compile: its fake implementation gives the output shape.
    On the NPU path the weight is packed [K, N]; with K != N the traced shape must still be [..., N]."""
    from ascend_adapters.common.quant import linear

    g = _g(7)
    k, n = 96, 40
    x = torch.randn(3, k, generator=g).to(torch.bfloat16)
    w = _npu("modelslim.pack_weight")(_int8((n, k), g))
    assert w.shape == (k, n)
    scale, offset = _npu("modelslim.pack_input_quant")(torch.tensor([0.05]), torch.tensor([3.0]), x.dtype)
    deq, qbias = torch.rand(n, generator=g) * 1e-3, torch.randint(-50, 50, (n,), generator=g, dtype=torch.int32)
    op = torch.ops.vllm.ascend_adapters_w8a8_static_linear
    eager = op(x, w, scale, offset, deq, qbias)
    assert linear._w8a8_static_linear_shape(x, w, scale, offset, deq, qbias).shape == eager.shape == (3, n)
    compiled = torch.compile(lambda *a: op(*a), backend="aot_eager", fullgraph=True)(x, w, scale, offset, deq, qbias)
    assert torch.equal(compiled, eager)


def test_int32_accumulation_makes_its_unit_scale_once_per_call(emulated, monkeypatch):
    """The exact int32 path (float32 activations, or K past 65535) runs npu_quant_matmul on K x N blocks;
    the unit scale each block takes is one tensor made once per call and sliced, not one per block."""
    from ascend_adapters.common.quant.kernels import npu

    g = _g(16)
    xq = torch.randint(-127, 128, (2, 65536 + 5), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (65536 + 5, 3), generator=g, dtype=torch.int8)
    made = []
    ones = torch.ones
    monkeypatch.setattr(npu.torch, "ones", lambda *a, **k: made.append(a) or ones(*a, **k))
    acc = npu._int32_matmul(xq, w)
    assert len(made) == 1  # two K blocks: the old loop made two
    assert torch.equal(acc, xq.int() @ w.int())
