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

On CPU, the dynamic linear takes the path ``cpu_layout`` chose for the serving dtype, once per process:
vLLM-CPU's prepacked oneDNN int8 GEMM (``compat.cpu_int8_gemm``) where a probe finds it exact on this CPU
(exact int32 accumulation inside oneDNN, per-token and per-channel scales and bias in float32, one
rounding to x.dtype; its fused quantizer only where a second probe finds it within float rounding of
``round(x / s)``); for bfloat16, the plain int8 weight through torch's int8pack kernel where the engine's
GEMM is not exact or much slower at decode sizes (``PackedInt8Linear``: one more bfloat16 rounding); else
the torch path below. A quantized layer keeps one copy of its weight (``EngineInt8Linear``'s prepacked one,
or ``PackedInt8Linear``'s plain one); the op itself, called with a plain weight, is the torch path.
Weights stay in the checkpoint layout ``[N, K]`` (``pack_weight`` is the identity here).

The routed experts (``w8a8_dynamic_moe``) run all of a step's routes at once with fixed shapes and no
host read (``common.kernels.experts``); their grouped integer GEMM always takes the float32 blocks,
through ``torch._grouped_mm`` (``grouped_int8_matmul`` says why).
"""

from __future__ import annotations

import torch

from ascend_adapters.common import dispatch
from ascend_adapters.common.kernels.activation import clamps, swiglu
from ascend_adapters.common.kernels.experts import Routes, grouped_experts, grouped_mm

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


@dispatch.portable("modelslim.pack_input_quant")
def pack_input_quant(
    input_scale: torch.Tensor, input_offset: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel form of a static layer's activation scale and offset (float32 ``[1]``) for ``dtype``
    activations: unchanged on the portable path (it divides by the scale in float32)."""
    return input_scale, input_offset


@dispatch.portable("modelslim.pack_moe_scale")
def pack_moe_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Kernel form of an expert projection's float32 ``[E, N]`` weight scales for ``dtype`` activations:
    unchanged on the portable path (it scales in float32)."""
    return scale


_ONEDNN_OK: bool | None = None  # None: ask compat once; tests set False to take the torch path


def _onednn():
    global _ONEDNN_OK
    from ascend_adapters.common import compat

    ops = compat.cpu_int8_gemm() if _ONEDNN_OK is not False else None
    if _ONEDNN_OK is None:
        _ONEDNN_OK = ops is not None
    return ops


# -- the engine's per-token quantizer, checked once per dtype against the equation ----------------
#
# vLLM-CPU's fused quantizer computes the same s = max|x| / 127 and round(x * fl(1/s)) where the
# equation has round(fl(x / s)): the two quotients differ by at most 3 u32 |x / s| (u32 = 2**-24), so
# they may round apart, by one step, only where x / s lies within 4 u32 |x / s| of a .5 boundary. Some
# builds do not keep that (on AVX2-only CPUs an all-zero row, s = 0, comes back as -128 instead of 0),
# so the engine's quantizer serves only where a probe finds it within that; ours serves elsewhere.

QUANTIZER_PROBE_TOKENS, QUANTIZER_PROBE_K = 16, 512


def _quantizer_probe(dtype: torch.dtype) -> torch.Tensor:
    """Seeded rows over several magnitudes, with an all-zero row (s = 0: the equation gives xq = 0)."""
    g = torch.Generator().manual_seed(0)
    # explicit float32: a vLLM worker loads with its serving dtype as torch's default
    x = torch.randn(QUANTIZER_PROBE_TOKENS, QUANTIZER_PROBE_K, generator=g, dtype=torch.float32)
    x = x * torch.logspace(-3, 3, QUANTIZER_PROBE_TOKENS, dtype=torch.float32).reshape(-1, 1)
    x[QUANTIZER_PROBE_TOKENS // 2] = 0
    return x.to(dtype).contiguous()


def quantizer_departure(xq: torch.Tensor, s: torch.Tensor, x: torch.Tensor) -> str | None:
    """Why ``(xq, s)`` is not the per-token equation for ``x`` within float rounding (None: it is)."""
    ours_q, ours_s = quantize_per_token(x)
    if s.shape != ours_s.shape or not torch.equal(s.float(), ours_s):
        return "its per-token scale is not max|x| / 127"
    quotient = x.double() / torch.where(ours_s > 0, ours_s, torch.ones_like(ours_s)).double()
    near_half = (quotient - quotient.floor() - 0.5).abs() <= 4 * 2.0**-24 * quotient.abs()
    step = (xq.int() - ours_q.int()).abs()
    bad = (step > 1) | ((step == 1) & ~near_half)
    if bad.any():
        t, k = (int(i) for i in torch.nonzero(bad)[0])
        return (
            f"{int(bad.sum())} of {bad.numel()} int8 values are not round(x / s) within float rounding "
            f"(first: x={float(x[t, k])!r}, s={float(ours_s[t, 0])!r}: {int(xq[t, k])}, not {int(ours_q[t, k])})"
        )
    return None


_ENGINE_QUANTIZER: dict[torch.dtype, str | None] = {}


def engine_quantizer_departure(dtype: torch.dtype) -> str | None:
    """None when the engine's quantizer keeps the equation for ``dtype`` activations, else why not (probed once)."""
    if dtype not in _ENGINE_QUANTIZER:
        x = _quantizer_probe(dtype)
        xq, s, _ = _onednn().onednn_scaled_int8_quant(x)
        _ENGINE_QUANTIZER[dtype] = quantizer_departure(xq, s, x)
    return _ENGINE_QUANTIZER[dtype]


_ENGINE_GEMM: list[str | None] = []


def engine_gemm_departure() -> str | None:
    """None when the engine's int8 GEMM accumulates full-range int8 x int8 products exactly, else why not.

    oneDNN without VNNI (AVX2, AVX-512 before VNNI) multiplies u8 x s8 pairs into int16 with saturation
    (``vpmaddubsw``), so full-range weights come out wrong in most outputs there; checked once per process
    on a seeded GEMM against the exact integer accumulator (float32 outputs: a few u32 of scaling apart)."""
    if not _ENGINE_GEMM:
        g = torch.Generator().manual_seed(0)
        xq = torch.randint(-127, 128, (8, 256), dtype=torch.int8, generator=g)
        w = torch.randint(-128, 128, (64, 256), dtype=torch.int8, generator=g)
        ops = _onednn()
        f32 = torch.float32  # explicit: a vLLM worker loads with its serving dtype as torch's default
        handle = ops.create_onednn_scaled_mm(w.t(), torch.ones(64, dtype=f32), f32, True, False)
        y = torch.empty(8, 64, dtype=f32)
        ops.onednn_scaled_mm(handle, xq, y, torch.ones(8, 1, dtype=f32), None, None, None)
        exact = xq.to(torch.int64) @ w.to(torch.int64).t()
        wrong = (y.double() - exact.double()).abs() > 4 * 2.0**-24 * exact.abs().double()
        _ENGINE_GEMM.append(
            None
            if not wrong.any()
            else f"its int8 GEMM is not exact on this CPU ({int(wrong.sum())} of {wrong.numel()} probe outputs wrong)"
        )
    return _ENGINE_GEMM[0]


class EngineInt8Linear:
    """A W8A8_DYNAMIC weight held only in the engine's prepacked form (vLLM-CPU's oneDNN int8 GEMM).

    Made once from the checkpoint-layout ``weight [N, K]`` and ``weight_scale [N]`` for outputs in
    ``out_dtype`` (the serving dtype); the engine copies the weight into its own blocked layout, so the
    caller may release the plain tensor, as vLLM's own CPU W8A8 kernel does. A call quantizes per token
    (the engine's fused quantizer where it keeps the equation, ``quantize_per_token`` elsewhere), then
    runs the GEMM (exact int32 accumulation, scales and bias applied in float32) writing ``out_dtype``
    once, with no float32 output buffer of its own.
    """

    path = "engine"

    def __init__(self, ops, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype):
        self._ops = ops
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype
        self.engine_quantizer = engine_quantizer_departure(out_dtype) is None
        scale = weight_scale.reshape(-1).float().contiguous()
        self._handle = ops.create_onednn_scaled_mm(weight.t(), scale, out_dtype, True, False)
        self.nbytes = weight.numel() * weight.element_size()  # the prepacked int8 copy (the layer keeps the scale)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(self.out_dtype).contiguous()
        y = torch.empty(x2.shape[0], self.out_features, dtype=self.out_dtype)
        if x2.shape[0] > 0:
            if self.engine_quantizer:
                xq, s, _ = self._ops.onednn_scaled_int8_quant(x2)
            else:
                xq, s = quantize_per_token(x2)
            b = None if bias is None else bias.to(self.out_dtype)
            self._ops.onednn_scaled_mm(self._handle, xq, y, s, None, None, b)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


class PackedInt8Linear:
    """A W8A8_DYNAMIC weight kept as the plain int8 ``[N, K]`` checkpoint tensor, multiplied by torch's
    weight-only int8 kernel (``aten._weight_int8pack_mm``) over the exact int8 activation values.

    For bfloat16 outputs: the kernel takes bfloat16 activations (every int8 value is exact in bfloat16),
    accumulates the integer products in float32 (exact while every partial sum stays below 2**24 in
    magnitude: always for K <= 1024, 1024 * 127 * 128 < 2**24) and writes the accumulator rounded to
    bfloat16; the per-token and per-channel scales and the bias are then applied in float32 and the
    result rounded to bfloat16 again. Against the equation's single rounding that is one more
    bfloat16 rounding (u = 2**-8) of ``acc * s * ws``: |y - ref| <= u |ref| + u (1 + u) |acc s ws| plus
    float32 terms (test_quant_kernels.py derives and checks it). Where the engine's oneDNN GEMM has no
    fast int8 kernel for a few tokens (AVX2 without VNNI), this is what keeps decode memory-bound.
    """

    path = "int8pack"

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype):
        if out_dtype != torch.bfloat16:
            raise ValueError(f"PackedInt8Linear serves bfloat16 outputs, not {out_dtype}")
        self.weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype
        self.scale = weight_scale.reshape(-1).float().contiguous()
        self._ones = torch.ones(self.out_features, dtype=torch.bfloat16)
        self.nbytes = self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, s = quantize_per_token(x2)
        acc = torch.ops.aten._weight_int8pack_mm(xq.to(torch.bfloat16), self.weight, self._ones)
        y = acc.float() * (s * self.scale.reshape(1, -1))
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


# -- which CPU linear serves W8A8_DYNAMIC weights in this process ----------------------------------

CALIBRATION_K = CALIBRATION_N = 2048
CALIBRATION_TOKENS = (1, 16)  # decode sizes: the regime where the two layouts differ most
PACKED_MARGIN = 2.0  # int8pack serves only when at least this much faster: a noisy timing never flips it


def _best_ms(fn, x: torch.Tensor, reps: int = 3) -> float:
    import time

    fn(x)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


_CPU_LAYOUT: dict[torch.dtype, dict] = {}


def cpu_layout(out_dtype: torch.dtype) -> dict:
    """How W8A8_DYNAMIC weights are served on CPU in this process for ``out_dtype`` outputs, decided once:
    ``{"path": "engine" | "int8pack" | "torch", "why": ..., "quantizer": ..., "decode_ms": {...}}``.

    Where the engine's GEMM is not exact (``engine_gemm_departure``: CPUs without VNNI), bfloat16 takes
    ``int8pack`` and other dtypes the torch path. Elsewhere, bfloat16: both layouts are timed on a
    CALIBRATION_K x CALIBRATION_N layer at CALIBRATION_TOKENS tokens and ``int8pack`` serves where its
    decode time is at most 1 / PACKED_MARGIN of the engine's; other dtypes: the engine (torch's kernel
    is vectorised for bfloat16 only).
    """
    if out_dtype in _CPU_LAYOUT:
        return _CPU_LAYOUT[out_dtype]
    ops = _onednn()
    gemm = engine_gemm_departure() if ops is not None else "this engine build has no oneDNN int8 GEMM"
    if gemm is not None:
        if out_dtype == torch.bfloat16:
            decision = {"path": "int8pack", "why": f"the engine's: {gemm}"}
        else:
            decision = {"path": "torch", "why": f"the engine's: {gemm}; int8pack is vectorised for bfloat16 only"}
    else:
        departure = engine_quantizer_departure(out_dtype)
        quantizer = "engine" if departure is None else f"ours (the engine's: {departure})"
        decision = {"path": "engine", "quantizer": quantizer}
        if out_dtype != torch.bfloat16:
            decision["why"] = f"{out_dtype}: torch's int8pack kernel is vectorised for bfloat16 only"
        else:
            g = torch.Generator().manual_seed(0)
            w = torch.randint(-127, 128, (CALIBRATION_N, CALIBRATION_K), dtype=torch.int8, generator=g)
            ws = torch.rand(CALIBRATION_N, generator=g, dtype=torch.float32) * 1e-2 + 1e-4
            engine, packed = EngineInt8Linear(ops, w, ws, out_dtype), PackedInt8Linear(w, ws, out_dtype)
            ms = {"engine": 0.0, "int8pack": 0.0}
            for t in CALIBRATION_TOKENS:
                x = torch.randn(t, CALIBRATION_K, generator=g, dtype=torch.float32).to(out_dtype)
                ms["engine"] += _best_ms(engine, x)
                ms["int8pack"] += _best_ms(packed, x)
            decision["decode_ms"] = {k: round(v, 3) for k, v in ms.items()}
            if ms["int8pack"] * PACKED_MARGIN <= ms["engine"]:
                decision["path"] = "int8pack"
                decision["why"] = f"decode {ms['engine'] / ms['int8pack']:.1f}x faster than the engine's GEMM"
            else:
                decision["why"] = f"int8pack is not {PACKED_MARGIN}x faster at decode sizes"
    _CPU_LAYOUT[out_dtype] = decision
    return decision


def cpu_dynamic_linear(
    weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype
) -> EngineInt8Linear | PackedInt8Linear | None:
    """The CPU W8A8_DYNAMIC linear for a plain ``weight [N, K]`` in this process's layout (``cpu_layout``),
    or None (not on CPU, or no engine: the torch path serves)."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    path = cpu_layout(out_dtype)["path"]
    if path == "engine":
        return EngineInt8Linear(_onednn(), weight, weight_scale, out_dtype)
    if path == "int8pack":
        return PackedInt8Linear(weight, weight_scale, out_dtype)
    return None


@dispatch.portable("modelslim.w8a8_dynamic_linear")
def w8a8_dynamic_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., K]`` float, ``weight [N, K]`` int8, ``weight_scale [N]`` float32 -> ``[..., N]`` in x.dtype.

    The portable reference of the op: exact int32 products, one rounding to x.dtype. A quantized layer on CPU
    runs the linear ``cpu_dynamic_linear`` made for its weight at load instead, where one serves."""
    scale = weight_scale.reshape(-1).float()
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


# the float32 copy of expert weights ``grouped_int8_matmul`` makes at a time: small enough that the allocator
# reuses it from call to call (a fresh multi-MiB buffer per block costs more in page faults than the copy)
# and that a large MoE layer's temporary stays bounded
F32_WEIGHT_BLOCK_BYTES = 8 << 20


def grouped_int8_matmul(xq: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Exact ``xq[i] @ w[g].T`` as int32 for every row i of group g: ``xq [R, K]`` int8, ``w [E, N, K]`` int8,
    ``offsets [E]`` int32 cumulative group sizes (``offsets[-1] == R``) -> ``[R, N]``.

    torch has no grouped integer GEMM, and a loop over experts either reads their row counts on the
    host or, with fixed shapes, multiplies every row by every expert. So the int8 values go through
    the float32 grouped GEMM (``experts.grouped_mm``) in blocks of at most EXACT_F32_BLOCK along K:
    every product is an integer of magnitude <= 127 * 128, every partial sum of a block one of
    magnitude < 1024 * 127 * 128 < 2**24, so each block is exact in float32 whatever the summation
    order; the blocks are summed in int32, as ``int8_matmul`` does. No float64 (Ascend devices have
    none). The price: each call converts this rank's expert weights to float32, a block of output
    columns at a time (at most F32_WEIGHT_BLOCK_BYTES); the number of blocks follows from the
    shapes alone. The NPU path runs ``npu_grouped_matmul`` on the int8 weights instead.
    """
    e, n, k = w.shape
    kb = min(k, EXACT_F32_BLOCK)
    nb = max(1, F32_WEIGHT_BLOCK_BYTES // (4 * e * kb))
    xf = xq.to(torch.float32)
    acc = torch.zeros(xq.shape[0], n, dtype=torch.int32, device=xq.device)
    for c in range(0, n, nb):
        cols = slice(c, min(c + nb, n))
        for a in range(0, k, kb):
            red = slice(a, min(a + kb, k))
            acc[:, cols] += grouped_mm(xf[:, red], w[:, cols, red].to(torch.float32), offsets).to(torch.int32)
    return acc


def _grouped_dynamic_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, routes: Routes) -> torch.Tensor:
    """``w8a8_dynamic_linear`` of each sorted row with its group's ``w [E, N, K]`` and ``scale [E, N]``: the
    same quantizer, exact accumulator and float32 scaling per row and channel, so the same values."""
    xq, s = quantize_per_token(x)
    acc = grouped_int8_matmul(xq, w, routes.offsets)
    ws = scale.reshape(w.shape[0], -1).float().index_select(0, routes.experts)
    return (acc.to(torch.float32) * (s * ws)).to(x.dtype)


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

    All T*k routes at once with fixed shapes and no host read (``experts.grouped_experts``): per
    projection one exact grouped integer GEMM (``grouped_int8_matmul``); each row's values are those
    of ``w8a8_dynamic_linear`` on that row with its expert's weight; the sum in float32.
    """

    def experts(rows: torch.Tensor, routes: Routes) -> torch.Tensor:
        h = _grouped_dynamic_linear(rows, w13, w13_scale, routes)
        a = _act(activation, h.float(), swiglu_limit).to(x.dtype)
        return _grouped_dynamic_linear(a, w2, w2_scale, routes)

    return grouped_experts(
        x,
        topk_weights,
        topk_ids,
        experts,
        num_experts=w13.shape[0],
        expert_map=expert_map,
        weight_on_input=apply_router_weight_on_input,
        acc_dtype=torch.float32,
    )
