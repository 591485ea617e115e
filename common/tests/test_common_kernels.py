"""common.kernels against their plain references (engine-free).

Bounds, with u the unit roundoff of the dtype computed in (2**-24 float32, 2**-8 bfloat16):

* ``common.swiglu``: silu(g) * u evaluated in float32 is two correctly rounded ops plus torch's
  silu (x * sigmoid(x): an exp, an add, a division and a product, each within u of its exact value),
  so |y - ref| <= 8u |ref| + the float32 rounding of |y| near zero (2**-126 is far below it; 1e-30
  covers exact zeros). The clamps are exact.
* ``common.rope_interleaved``: each output is a cos - b sin from two products and one sum in float32
  (3u relative to |a cos| + |b sin|) and one rounding to x's dtype (u |y|).
* ``common.swiglu_experts``: the portable form runs one grouped GEMM per projection over all routes
  (``torch._grouped_mm``: the same dot products as a matmul per expert) and sums in x's dtype; the
  reference is float64, one route at a time. Each route's term is two matmuls of depth K (|error| <=
  K u |a| |b| for a dot product of length K, the classic bound), the SwiGLU (8u) and the weight
  product (u); the sum over k routes adds k u. The test bounds the normwise error by
  (2 max(H, I) + 8 + 2 + k) u, the first-order sum of these. Zero-padding an unaligned contraction
  dimension adds exact zero products and changes none of it.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ascend_adapters.common import dispatch  # noqa: E402
from ascend_adapters.common.kernels import activation, experts, rope  # noqa: E402

U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def _g(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("limit", [None, 0.0, 1.5])
def test_swiglu_matches_the_formula(limit):
    h = torch.randn(7, 2, 64, generator=_g(1)) * 4
    y = dispatch.op("common.swiglu")(h, limit)
    ref = activation.swiglu_reference(h, limit)
    assert y.shape == (7, 2, 32) and y.dtype == h.dtype
    assert ((y.double() - ref).abs() <= 8 * U[torch.float32] * ref.abs() + 1e-30).all()
    if limit:
        gate, up = h.chunk(2, dim=-1)
        # the clamps act: where gate > limit, y = silu(limit) * clamp(up); check one such element exists
        assert bool((gate > limit).any()) and bool((up.abs() > limit).any())


def test_swiglu_limit_none_and_zero_are_the_plain_swiglu():
    h = torch.randn(5, 16, generator=_g(2)) * 9
    gate, up = h.chunk(2, dim=-1)
    plain = torch.nn.functional.silu(gate) * up
    assert torch.equal(dispatch.op("common.swiglu")(h, None), plain)
    assert torch.equal(dispatch.op("common.swiglu")(h, 0.0), plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(6, 4, 32), (6, 32), (6, 3, 48)], ids=["full", "2d", "trailing"])
def test_rope_interleaved_matches_the_complex_product(dtype, shape):
    g = _g(3)
    rd = 32
    x = torch.randn(*shape, generator=g).to(dtype)
    ang = torch.rand(shape[0], rd // 2, generator=g) * 6.28
    cos, sin = ang.cos(), ang.sin()
    y = dispatch.op("common.rope_interleaved")(x, cos, sin)
    ref = rope.rope_interleaved_reference(x, cos, sin)
    assert y.shape == x.shape and y.dtype == dtype
    # the leading (nope) channels pass through unchanged
    assert torch.equal(y[..., :-rd], x[..., :-rd])
    a, b = x.double()[..., -rd:][..., 0::2], x.double()[..., -rd:][..., 1::2]
    pair = (a.abs() + b.abs()).repeat_interleave(2, -1)
    bound = 3 * U[torch.float32] * pair + U[dtype] * ref[..., -rd:].abs() + 1e-30
    assert ((y[..., -rd:].double() - ref[..., -rd:]).abs() <= bound).all()


def test_rope_inverse_undoes_rope():
    x = torch.randn(5, 2, 16, generator=_g(4))
    ang = torch.rand(5, 8, generator=_g(5)) * 6.28
    op = dispatch.op("common.rope_interleaved")
    back = op(op(x, ang.cos(), ang.sin()), ang.cos(), -ang.sin())
    # two rotations, each within 3u relative per pair (see the bound above), and cos^2 + sin^2 = 1
    # within 2u: |back - x| <= 8u (|a| + |b|) per element
    pair = (x[..., 0::2].abs() + x[..., 1::2].abs()).repeat_interleave(2, -1)
    assert ((back - x).abs() <= 8 * U[torch.float32] * pair).all()


def _moe_case(seed, e=5, h=32, i=24, t=11, k=2, dtype=torch.float32):
    g = _g(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    ids = torch.randint(0, e, (t, k), generator=g)
    wts = torch.rand(t, k, generator=g)
    return x, w13, w2, wts, ids


def _moe_bound(dtype, h, i, k):
    return (2 * max(h, i) + 8 + 2 + k) * U[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("limit", [None, 1.0])
def test_swiglu_experts_match_the_route_by_route_reference(dtype, limit):
    x, w13, w2, wts, ids = _moe_case(6, dtype=dtype)
    y = dispatch.op("common.swiglu_experts")(x, w13, w2, wts, ids, limit=limit)
    ref = experts.grouped_experts_reference(x, wts, ids, experts.swiglu_expert_reference(w13, w2, limit))
    assert y.dtype == dtype and y.shape == x.shape
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert rel <= _moe_bound(dtype, 32, 24, 2), rel


def _rel(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def test_swiglu_experts_honour_expert_map_and_negative_routes():
    x, w13, w2, wts, ids = _moe_case(7, e=6)
    ids[0, 0] = -1  # no route
    ids[1] = -1  # no route at all
    # this rank holds global experts 1, 3 and 4 as local 0, 1, 2
    emap = torch.full((6,), -1, dtype=torch.long)
    emap[torch.tensor([1, 3, 4])] = torch.arange(3)
    local_w13, local_w2 = w13[[1, 3, 4]], w2[[1, 3, 4]]
    y = dispatch.op("common.swiglu_experts")(x, local_w13, local_w2, wts, ids, expert_map=emap, limit=None)
    ref = experts.grouped_experts_reference(
        x, wts, ids, experts.swiglu_expert_reference(local_w13, local_w2, None), expert_map=emap
    )
    assert _rel(y, ref) <= _moe_bound(torch.float32, 32, 24, 2)
    # tokens whose routes all lead to other ranks (or nowhere) get exactly zero
    elsewhere = ~torch.isin(ids, torch.tensor([1, 3, 4])).any(dim=1)
    assert bool(elsewhere.any()) and torch.equal(y[elsewhere], torch.zeros_like(y[elsewhere]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "routing", ["idle_experts", "one_expert", "last_expert_idle", "all_elsewhere", "one_token"], ids=str
)
def test_swiglu_experts_any_routing_within_the_bound(dtype, routing):
    """Experts with no token (the last one too: its group also holds the routes of no local expert),
    every route to one expert, every route to another rank, a single token."""
    x, w13, w2, wts, ids = _moe_case(9, e=5, t=13, k=3, dtype=dtype)
    emap = None
    if routing == "idle_experts":
        ids = ids % 2 * 3  # experts 0 and 3 only
    elif routing == "one_expert":
        ids = torch.full_like(ids, 2)
    elif routing == "last_expert_idle":
        ids = ids % 4
        ids[::3, 0] = -1
    elif routing == "all_elsewhere":
        emap = torch.full((10,), -1, dtype=torch.long)
        emap[5:] = torch.arange(5)  # this rank holds global 5..9; every route is to 0..4
    else:
        x, wts, ids = x[:1], wts[:1], ids[:1]
    y = dispatch.op("common.swiglu_experts")(x, w13, w2, wts, ids, expert_map=emap, limit=1.0)
    assert y.dtype == dtype and y.shape == x.shape
    if routing == "all_elsewhere":
        assert torch.equal(y, torch.zeros_like(y))
        return
    ref = experts.grouped_experts_reference(x, wts, ids, experts.swiglu_expert_reference(w13, w2, 1.0), expert_map=emap)
    assert _rel(y, ref) <= _moe_bound(dtype, 32, 24, 3), _rel(y, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_swiglu_experts_unaligned_dims_are_padded(dtype):
    """H = 30 and I = 13 are no multiple of 16 bytes in either dtype: torch._grouped_mm refuses such
    strides, so both contraction dimensions are zero-padded (zero products: the same bound)."""
    h, i = 30, 13
    x, w13, w2, wts, ids = _moe_case(10, e=4, h=h, i=i, dtype=dtype)
    with pytest.raises(RuntimeError, match="16 bytes"):
        torch._grouped_mm(x, w13.transpose(1, 2), offs=torch.tensor([0, 0, 0, x.shape[0]], dtype=torch.int32))
    y = dispatch.op("common.swiglu_experts")(x, w13, w2, wts, ids, limit=None)
    ref = experts.grouped_experts_reference(x, wts, ids, experts.swiglu_expert_reference(w13, w2, None))
    assert _rel(y, ref) <= _moe_bound(dtype, h, i, 2), _rel(y, ref)


def test_grouped_mm_is_a_matmul_per_group():
    """``experts.grouped_mm`` against one matmul per group, float32 (the same dot products: equal
    within the classic dot-product bound K u sum |a||b|), with empty groups first, inside and last."""
    g = _g(11)
    rows, w = torch.randn(9, 20, generator=g), torch.randn(5, 7, 20, generator=g)
    sizes = [0, 4, 0, 5, 0]
    offsets = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    y = experts.grouped_mm(rows, w, offsets)
    groups = torch.repeat_interleave(torch.arange(5), torch.tensor(sizes))
    ref = torch.stack([rows[r].double() @ w[e].double().t() for r, e in enumerate(groups.tolist())])
    mag = torch.stack([rows[r].double().abs() @ w[e].double().abs().t() for r, e in enumerate(groups.tolist())])
    assert ((y.double() - ref).abs() <= 20 * U[torch.float32] * mag).all()


def test_grouped_experts_weight_on_input_and_empty():
    x, w13, w2, wts, ids = _moe_case(8, k=1)
    h = x.shape[1]

    def linear_experts(rows, routes):  # linear in the input: weighting before or after is the same map
        return experts.grouped_mm(rows, w13[:, :h], routes.offsets)

    on_in = experts.grouped_experts(x, wts, ids, linear_experts, num_experts=5, weight_on_input=True)
    after = experts.grouped_experts(x, wts, ids, linear_experts, num_experts=5, acc_dtype=torch.float32)
    # each side is one float32 dot product of length H per element (error <= H u sum |x||w|, the
    # classic bound) plus the weight product and the cast (2u): the two differ by at most twice that
    w_abs = w13[:, :h].abs().amax(dim=0)
    bound = 2 * (h + 2) * U[torch.float32] * (x.abs() @ w_abs.t()) * wts.abs().amax() + 1e-30
    assert ((on_in - after).abs() <= bound).all()
    empty = experts.grouped_experts(x[:0], wts[:0], ids[:0], linear_experts, num_experts=5)
    assert empty.shape == (0, x.shape[1])


def _engine_or_skip(w13, w2):
    engine = experts.engine_swiglu_experts(w13, w2)
    if isinstance(engine, str):
        pytest.skip(f"vLLM-CPU's oneDNN experts path: {engine}")
    return engine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("routing", ["spread", "idle_experts", "expert_map", "one_token"], ids=str)
def test_engine_swiglu_experts_match_the_route_by_route_reference(dtype, routing):
    """The vLLM-CPU path (each expert's rows through its prepacked oneDNN handle) within the portable op's
    bound: the same dot products of depth H and I, only in the engine's summation order."""
    x, w13, w2, wts, ids = _moe_case(11, e=6, t=17, k=3, dtype=dtype)
    emap, held = None, list(range(6))
    if routing == "idle_experts":
        ids = ids % 2 * 5  # experts 0 and 5 only
    elif routing == "expert_map":
        ids[0, 0], ids[1] = -1, -1
        held = [1, 3, 4]  # this rank holds global experts 1, 3 and 4 as local 0, 1, 2
        emap = torch.full((6,), -1, dtype=torch.long)
        emap[torch.tensor(held)] = torch.arange(3)
    elif routing == "one_token":
        x, wts, ids = x[:1], wts[:1], ids[:1]
    w13, w2 = w13[held].contiguous(), w2[held].contiguous()
    engine = _engine_or_skip(w13, w2)
    y = experts.engine_swiglu_experts_forward(
        x, engine.handles13, engine.handles2, engine.width13, engine.hidden, wts, ids, emap, 1.0
    )
    assert y.dtype == dtype and y.shape == x.shape
    ref = experts.grouped_experts_reference(x, wts, ids, experts.swiglu_expert_reference(w13, w2, 1.0), expert_map=emap)
    assert _rel(y, ref) <= _moe_bound(dtype, 32, 24, 3), _rel(y, ref)
    if routing == "expert_map":  # tokens whose routes all lead elsewhere get exactly zero
        elsewhere = ~torch.isin(ids, torch.tensor(held)).any(dim=1)
        assert bool(elsewhere.any()) and torch.equal(y[elsewhere], torch.zeros_like(y[elsewhere]))
