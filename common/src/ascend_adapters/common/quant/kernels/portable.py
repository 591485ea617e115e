"""Portable torch implementation of the ModelSlim W8A8 kernels (CPU, any device).

The integer part is exact: int8 x int8 products are accumulated in int32
(``torch._int_mm`` where the backend has it; otherwise float32 matmuls over
blocks of at most 1024 along K, each exact because every partial sum is an
integer of magnitude <= 1024 * 128 * 128 = 2**24, summed in int32). No float64:
Ascend devices have none. Rounding is round-half-to-even
(``torch.round``). The equations are those of docs/references.md#modelslim-w8a8-math:

    dynamic: s[t] = max|x[t]| / 127, xq = round(x / s), y = (xq @ W.T) * weight_scale[n] * s[t] (+ bias)
    static:  xq = clamp(round(x / input_scale + input_offset), -128, 127)
             y  = (xq @ W.T + quant_bias) * deq_scale

An all-zero activation row gives s = 0 and xq = 0, so y = bias (never NaN).

On CPU, the dynamic linear runs vLLM-CPU's own W8A8 path where the engine has it (``compat.cpu_int8_gemm``,
weight prepacked once per weight tensor and output dtype): the engine's fused per-token quantizer (the
same scale s; it multiplies by 1/s, so an activation within float rounding of a .5 boundary may land
one int8 step from ``round(x / s)``), exact int32 accumulation inside oneDNN, the per-token and
per-channel scales and the bias applied in float32 and one rounding to x.dtype, written straight into
the output (test_quant_kernels.py checks it against the exact integer accumulator on the engine's own
int8 activations). A quantized layer keeps only the engine's prepacked copy (``EngineInt8Linear``); a
plain weight passed to the op keeps its prepacked copy beside it.
Weights stay in the checkpoint layout ``[N, K]`` (``pack_weight`` is the identity here).
"""

from __future__ import annotations

import torch

from ascend_adapters.common import dispatch
from ascend_adapters.common.kernels.activation import clamps, swiglu
from ascend_adapters.common.kernels.experts import grouped_experts, local_routes  # noqa: F401  (local_routes: re-export)

_INT_MM_OK: bool | None = None

# float32 represents every integer up to 2**24 exactly; a block of 1024 int8 x int8 products sums to at most
# 1024 * 128 * 128 = 2**24 in magnitude, so each block's float32 matmul is exact whatever the summation order.
EXACT_F32_BLOCK = 1024


# a property of this torch build, decided once: under vLLM's torch.compile the answer is a constant of
# the traced graph, not a data-dependent branch (its probe reads a tensor value)
@torch.compiler.assume_constant_result
def _int_mm_available() -> bool:
    global _INT_MM_OK
    if _INT_MM_OK is None:
        try:
            a = torch.ones(2, 3, dtype=torch.int8)
            _INT_MM_OK = bool(torch._int_mm(a, a.t().contiguous()).sum() == 12)
        except Exception:
            _INT_MM_OK = False
    return _INT_MM_OK


def int8_matmul(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact ``xq [T, K] int8 @ w[N, K].T -> int32 [T, N]``."""
    if xq.dtype != torch.int8 or w.dtype != torch.int8:
        raise TypeError(f"int8_matmul needs int8 operands, got {xq.dtype} and {w.dtype}")
    if xq.shape[0] == 0:
        return torch.zeros(0, w.shape[0], dtype=torch.int32, device=xq.device)
    if xq.device.type == "cpu" and _int_mm_available():
        return torch._int_mm(xq.contiguous(), w.t())
    K = xq.shape[1]
    acc = torch.zeros(xq.shape[0], w.shape[0], dtype=torch.int32, device=xq.device)
    for a in range(0, K, EXACT_F32_BLOCK):
        b = min(a + EXACT_F32_BLOCK, K)
        acc += (xq[:, a:b].to(torch.float32) @ w[:, a:b].t().to(torch.float32)).to(torch.int32)
    return acc


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-token int8 quantization: ``(xq int8 [T, K], s float32 [T, 1])``."""
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True) / 127.0
    safe = torch.where(s > 0, s, torch.ones_like(s))
    xq = torch.round(xf / safe).clamp_(-127, 127).to(torch.int8)
    return xq, s


def quantize_per_tensor(x: torch.Tensor, input_scale: torch.Tensor, input_offset: torch.Tensor) -> torch.Tensor:
    """Asymmetric per-tensor int8 quantization with the checkpoint's scale and offset."""
    xf = x.float()
    return torch.round(xf / input_scale.float() + input_offset.float()).clamp_(-128, 127).to(torch.int8)


@dispatch.portable("modelslim.pack_weight")
def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """Kernel layout of an int8 ``[N, K]`` (or ``[E, N, K]``) weight: unchanged on the portable path."""
    return weight.contiguous()


_ONEDNN_OK: bool | None = None  # None: ask compat once; tests set False to take the torch path


def _onednn():
    global _ONEDNN_OK
    from ascend_adapters.common import compat

    ops = compat.cpu_int8_gemm() if _ONEDNN_OK is not False else None
    if _ONEDNN_OK is None:
        _ONEDNN_OK = ops is not None
    return ops


class EngineInt8Linear:
    """A W8A8_DYNAMIC weight held only in the engine's prepacked form (vLLM-CPU's oneDNN int8 GEMM).

    Made once from the checkpoint-layout ``weight [N, K]`` and ``weight_scale [N]`` for outputs in
    ``out_dtype`` (the serving dtype); the engine copies the weight into its own blocked layout, so the
    caller may release the plain tensor, as vLLM's own CPU W8A8 kernel does. A call runs what vLLM's
    CPU W8A8 linear runs: the engine's fused per-token quantizer, then the GEMM (exact int32
    accumulation, scales and bias applied in float32) writing ``out_dtype`` once, with no float32
    output buffer or quantization temporaries of its own.
    """

    def __init__(self, ops, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype):
        self._ops = ops
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype
        scale = weight_scale.reshape(-1).float().contiguous()
        self._handle = ops.create_onednn_scaled_mm(weight.t(), scale, out_dtype, True, False)
        self.nbytes = weight.numel() * weight.element_size()  # the prepacked int8 copy (the layer keeps the scale)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(self.out_dtype).contiguous()
        y = torch.empty(x2.shape[0], self.out_features, dtype=self.out_dtype)
        if x2.shape[0] > 0:
            xq, s, _ = self._ops.onednn_scaled_int8_quant(x2)
            b = None if bias is None else bias.to(self.out_dtype)
            self._ops.onednn_scaled_mm(self._handle, xq, y, s, None, None, b)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


def engine_int8_linear(
    weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype
) -> EngineInt8Linear | None:
    """The engine's prepacked W8A8_DYNAMIC linear for a CPU weight, or None (no engine GEMM, not on CPU)."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    ops = _onednn()
    return EngineInt8Linear(ops, weight, weight_scale, out_dtype) if ops is not None else None


def _cached_engine_linear(weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> EngineInt8Linear | None:
    """For callers that pass a plain weight: prepacked once per weight tensor and output dtype, kept beside it.

    Only for a weight that owns its storage; views (an expert sliced out of a stacked tensor per call)
    take the torch path rather than prepacking on every call.
    """
    if weight._base is not None or weight.requires_grad or not scale.is_contiguous():
        return None
    cache = weight.__dict__.setdefault("_ascend_onednn", {})
    key = (scale.data_ptr(), scale.numel(), out_dtype)
    if key not in cache:
        cache[key] = engine_int8_linear(weight, scale, out_dtype)
    return cache[key]


@dispatch.portable("modelslim.w8a8_dynamic_linear")
def w8a8_dynamic_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., K]`` float, ``weight [N, K]`` int8, ``weight_scale [N]`` float32 -> ``[..., N]`` in x.dtype."""
    scale = weight_scale.reshape(-1).float()
    engine = _cached_engine_linear(weight, scale, x.dtype) if x.device.type == "cpu" and _onednn() is not None else None
    if engine is not None:
        return engine(x, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq, s = quantize_per_token(x2)
    acc = int8_matmul(xq, weight)
    y = acc.to(torch.float32) * (s * scale.reshape(1, -1))
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], weight.shape[0])


@dispatch.portable("modelslim.w8a8_static_linear")
def w8a8_static_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    input_offset: torch.Tensor,
    deq_scale: torch.Tensor,
    quant_bias: torch.Tensor | None,
) -> torch.Tensor:
    """Static W8A8: ``deq_scale`` float32 [N]; ``quant_bias`` int32 [N] or None (row-parallel rank > 0)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq = quantize_per_tensor(x2, input_scale, input_offset)
    acc = int8_matmul(xq, weight)
    if quant_bias is not None:
        acc = acc + quant_bias.to(torch.int32).reshape(1, -1)
    y = acc.to(torch.float32) * deq_scale.reshape(1, -1).float()
    return y.to(x.dtype).reshape(*shape[:-1], weight.shape[0])


def _act(name: str, h: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    if name == "silu":
        return swiglu(h, swiglu_limit)
    if clamps(swiglu_limit):
        raise ValueError(f"W8A8_DYNAMIC MoE: swiglu_limit needs activation 'silu', got {name!r}")
    if name == "gelu":
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate) * up
    raise ValueError(f"W8A8_DYNAMIC MoE: activation {name!r} is not supported (silu, gelu)")


@dispatch.portable("modelslim.w8a8_dynamic_moe")
def w8a8_dynamic_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Routed experts with W8A8_DYNAMIC weights.

    ``x [T, H]``; ``w13 [E, 2I, H]`` int8 with ``w13_scale [E, 2I]``; ``w2 [E, H, I]`` int8 with
    ``w2_scale [E, H]``; ``topk_ids [T, k]`` global expert ids (negative: no route);
    ``expert_map [E_global]`` global -> local id (-1: not on this rank). Returns ``[T, H]`` in x.dtype,
    the router-weighted sum over the local experts (the caller reduces across ranks).
    ``swiglu_limit`` (> 0) clamps the SwiGLU inputs: gate <= limit, -limit <= up <= limit.
    """

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = w8a8_dynamic_linear(rows, w13[e], w13_scale[e].reshape(-1))
        a = _act(activation, h.float(), swiglu_limit).to(x.dtype)
        return w8a8_dynamic_linear(a, w2[e], w2_scale[e].reshape(-1))

    return grouped_experts(
        x,
        topk_weights,
        topk_ids,
        expert,
        num_experts=w13.shape[0],
        expert_map=expert_map,
        weight_on_input=apply_router_weight_on_input,
        acc_dtype=torch.float32,
    )
