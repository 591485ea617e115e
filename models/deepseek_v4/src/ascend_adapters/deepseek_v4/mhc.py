"""Which implementation runs DeepSeek-V4's hyper-connection (mHC) ops: chosen once, here.

vLLM's own ``MHCPreOp`` / ``MHCPostOp`` / ``HCHeadOp`` (CustomOps; a platform plugin such as
vllm-ascend substitutes its kernels through them) where the engine has them
(``compat.mhc_op_classes``) and they serve this model's call, else the portable ``dsv4.hc_*`` ops
in ``kernels.py``, which stay the reference beside them. The math is the same (checked in
``tests/test_deepseek_v4_mhc.py``): one merged ``hc_eps`` for the pre-mix and the Sinkhorn
normalisations, post multiplier 2, ``hc_sinkhorn_iters`` Sinkhorn rounds. vLLM's post op adds in
float32 and rounds once; the portable one (as transformers) rounds ``post``/``comb`` to the stream
dtype first.

"Serves the call" is found out by calling each op once on a one-token input of the model's dtype,
``hc_mult`` and hidden size: vLLM declares no capability of its own, and what runs depends on
engine and platform (vLLM 0.32's CPU kernels take bfloat16/float16 activations only; 0.27/0.28 on
CPU fall back to a bfloat16-only torch reference, and have no ``HCHeadOp`` there). An op that
raises is not used; float32 models always take the portable ops. Each op is decided by common's
``dispatch.choose`` (vLLM's op as the one candidate); ``HCOps.source`` says which implementation
each op got and why. ``ASCEND_ADAPTERS_DEEPSEEK_V4_PORTABLE_MHC=on`` keeps all three on the portable
ops.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ascend_adapters.common import compat, dispatch
from ascend_adapters.common.flags import env_flag
from ascend_adapters.deepseek_v4 import kernels as _kernels  # noqa: F401  (registers the portable ops)

POST_MULT = 2.0  # DeepSeek-V4's post-mix multiplier (2 * sigmoid)
VLLM = "vllm"
PORTABLE_MHC_ENV = "ASCEND_ADAPTERS_DEEPSEEK_V4_PORTABLE_MHC"  # on: the portable ops, never vLLM's
logger = logging.getLogger("ascend_adapters")
# The activation dtypes vLLM's mHC ops are specified for (their docstrings; 0.32's CPU kernels refuse
# float32, while 0.27/0.28's torch fallback of the post op would run it unspecified).
VLLM_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class HCOps:
    """The three mHC ops, each with the portable op's signature (``kernels.hc_pre`` etc.)."""

    pre: Callable
    post: Callable
    head: Callable
    source: dict  # "pre" / "post" / "head" -> "vllm" or "portable: <why>"


def hc_ops(config, dtype: torch.dtype) -> HCOps:
    """The mHC ops for ``config`` served in ``dtype`` (cached: decided once per process and shape)."""
    return _select(
        dtype,
        int(config.hc_mult),
        int(config.hidden_size),
        int(config.hc_sinkhorn_iters),
        float(config.hc_eps),
        float(config.rms_norm_eps),
    )


@functools.lru_cache(maxsize=8)
def _select(dtype, n: int, hidden: int, iters: int, hc_eps: float, norm_eps: float) -> HCOps:
    wrappers = {"pre": _vllm_pre, "post": _vllm_post, "head": _vllm_head}
    fns, source = {}, {}
    for name, wrap in wrappers.items():

        def make(name=name, wrap=wrap):
            if dtype not in VLLM_DTYPES:
                return f"vLLM's mHC ops take bfloat16/float16, not {dtype}"
            classes = compat.mhc_op_classes()
            if classes is None:
                return "this vLLM has no mHC ops"
            fn = wrap(getattr(classes, name)())
            why = _probe(name, fn, dtype, n, hidden, iters, hc_eps, norm_eps)
            return fn if why is None else f"vLLM's op does not serve this call ({why})"

        choice = dispatch.choose(f"dsv4.hc_{name}", [(VLLM, make)], switch=PORTABLE_MHC_ENV)
        fns[name], source[name] = choice.fn, choice.source
    if dtype in VLLM_DTYPES and not env_flag(PORTABLE_MHC_ENV) and compat.mhc_op_classes() is not None:
        logger.info("ascend_adapters.deepseek_v4: mHC ops for %s, hidden %d: %s", dtype, hidden, source)
    return HCOps(**fns, source=source)


def _vllm_pre(op) -> Callable:
    def pre(streams, fn, base, scale, *, sinkhorn_iters, hc_eps, norm_eps):
        post, comb, collapsed = op(streams, fn, scale, base, norm_eps, hc_eps, hc_eps, POST_MULT, sinkhorn_iters)
        return post.squeeze(-1), comb, collapsed

    return pre


def _vllm_post(op) -> Callable:
    def post(streams, block_out, post, comb):
        return op(block_out, streams, post.unsqueeze(-1), comb)

    return post


def _vllm_head(op) -> Callable:
    def head(streams, fn, base, scale, *, hc_eps, norm_eps):
        return op(streams, fn, scale, base, norm_eps, hc_eps)

    return head


def _probe(name, fn, dtype, n, hidden, iters, hc_eps, norm_eps) -> str | None:
    """None when ``fn`` runs a one-token call of this shape and dtype and returns the portable shapes."""
    f32 = torch.float32
    streams = torch.ones(1, n, hidden, dtype=dtype)
    try:
        if name == "pre":
            out = fn(
                streams,
                torch.zeros((2 + n) * n, n * hidden, dtype=f32),
                torch.zeros((2 + n) * n, dtype=f32),
                torch.ones(3, dtype=f32),
                sinkhorn_iters=iters,
                hc_eps=hc_eps,
                norm_eps=norm_eps,
            )
            want = [((1, n), f32), ((1, n, n), f32), ((1, hidden), dtype)]
        elif name == "post":
            out = fn(
                streams, torch.ones(1, hidden, dtype=dtype), torch.ones(1, n, dtype=f32), torch.eye(n, dtype=f32)[None]
            )
            want = [((1, n, hidden), dtype)]
        else:
            out = fn(
                streams,
                torch.zeros(n, n * hidden, dtype=f32),
                torch.zeros(n, dtype=f32),
                torch.ones(1, dtype=f32),
                hc_eps=hc_eps,
                norm_eps=norm_eps,
            )
            want = [((1, hidden), dtype)]
    except Exception as exc:  # NotImplementedError, a kernel's dtype/eps check, an assertion
        return " ".join(f"{type(exc).__name__}: {exc}".split()).rstrip(":")
    got = [(tuple(t.shape), t.dtype) for t in (out if isinstance(out, tuple) else (out,))]
    return None if got == want else f"returned {got}, expected {want}"
