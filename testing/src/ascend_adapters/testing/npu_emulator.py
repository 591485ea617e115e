"""A CPU stand-in for the torch_npu operators this project calls: a CONTRACT CHECK, NOT AN NPU RUN.

Each function below takes the arguments of the torch_npu operator of the same name, refuses every
input its documentation does not allow (dtype combinations, ranks, layouts, group_list rules, size
limits) with an :class:`NpuContractError` naming the argument, and otherwise computes the documented
formula on CPU. The rule beside each check cites the Ascend op-plugin page it comes from
(``docs/zh/custom_APIs/torch_npu/<page>.md`` in github.com/Ascend/op-plugin, read at commit 517f2e7d,
2026-08-21; npu_clipped_swiglu at 12c385b8 and npu_grouped_matmul's float rows at 02ea4757) and the section (功能说明 = description/formula, 参数说明 = parameters,
约束说明 = constraints). ``npu_moe_token_unpermute`` has no page there: its rules cite the operator's
own page, ``moe/moe_token_unpermute/docs/aclnnMoeTokenUnpermute.md`` in the CANN ops-transformer
repository (github.com/hicann/ops-transformer, read at commit 37b9e45d), which torch_npu calls
straight through. Where this project relies on a behaviour the page does not state (rounding
mode, saturation, an all-zero row), the emulator picks one and says "(unverified)".

Nothing here says anything about NPU speed or about kernel bugs; it says that the calls the NPU
path makes are calls the documentation accepts, and that their documented math gives the same
answer as the portable kernels.

Install it as ``torch_npu`` for one process with :func:`install` (tests), or for a vLLM server by
putting :func:`write_shim`'s folder first on ``PYTHONPATH``. The kernel path then takes the NPU
implementation for CPU tensors only when ``ASCEND_ADAPTERS_NPU_EMULATOR=1`` is set as well
(``ascend_adapters.common.platform``); with the real torch_npu that variable is refused.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch

IS_CONTRACT_EMULATOR = True

_DOCS = "op-plugin docs/zh/custom_APIs/torch_npu/"
_INT8_MAX = 127


class NpuContractError(ValueError):
    """A call that torch_npu's documentation does not allow."""


TRACE_ENV = "ASCEND_ADAPTERS_EMULATOR_TRACE_DIR"
_SEEN: set[str] = set()


def _trace(op: str) -> None:
    """Under ``ASCEND_ADAPTERS_EMULATOR_TRACE_DIR``, note once per process that ``op`` ran (served tests)."""
    import os

    folder = os.environ.get(TRACE_ENV)
    if folder and op not in _SEEN:
        _SEEN.add(op)
        Path(folder, f"{os.getpid()}-{op}").write_text("called\n")


def _require(ok: bool, op: str, page: str, section: str, message: str, docs: str = _DOCS) -> None:
    if not ok:
        raise NpuContractError(f"{op}: {message} [{docs}{page} {section}]")


def _round_int8(v: torch.Tensor) -> torch.Tensor:
    # Round half to even and saturate to int8 (unverified: the pages give the formula, not the rounding mode).
    return torch.round(v).clamp_(-128, 127).to(torch.int8)


# --- npu_dynamic_quant -------------------------------------------------------------------------------
_DQ = "torch_npu-npu_dynamic_quant.md"


def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None):
    op = "npu_dynamic_quant"
    _trace(op)
    # 参数说明 x: "数据类型支持float16、bfloat16" ... "输入x的维度必须大于1"
    _require(
        x.dtype in (torch.float16, torch.bfloat16), op, _DQ, "参数说明 x", f"x dtype {x.dtype} (float16/bfloat16 only)"
    )
    _require(x.dim() > 1, op, _DQ, "参数说明 x", f"x must have more than 1 dimension, got {tuple(x.shape)}")
    # 参数说明 dst_type: None is int8; quint4x2 is not used by this project and not emulated
    _require(dst_type in (None, torch.int8), op, _DQ, "参数说明 dst_type", f"dst_type {dst_type} not emulated (int8)")
    if smooth_scales is not None or group_index is not None:
        raise NotImplementedError(f"{op}: smooth_scales/group_index are not emulated (this project does not pass them)")
    # 功能说明: scale = rowMax(abs(x)) / DTYPE_MAX; y = round(x / scale)
    # 返回值说明: scale is float32 with the shape of x minus its last dimension
    xf = x.float()
    scale = xf.abs().amax(dim=-1)
    scale = scale / _INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero row -> y = 0 (unverified)
    y = _round_int8(xf / safe.unsqueeze(-1))
    return y, scale


# --- npu_quantize ------------------------------------------------------------------------------------
_Q = "torch_npu-npu_quantize.md"


def npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):
    op = "npu_quantize"
    _trace(op)
    floats = (torch.float32, torch.float16, torch.bfloat16)
    # 参数说明 input (A2/A3): float, float16, bfloat16
    _require(input.dtype in floats, op, _Q, "参数说明 input", f"input dtype {input.dtype}")
    # 参数说明 dtype (div_mode False): qint8, quint4x2; quint4x2 is not emulated
    _require(dtype in (torch.qint8, torch.int8), op, _Q, "参数说明 dtype", f"dtype {dtype} not emulated (qint8)")
    if div_mode:
        # 参数说明 scales (div_mode True): float, bfloat16; zero_points: int8, uint8, int32, bfloat16
        _require(scales.dtype in (torch.float32, torch.bfloat16), op, _Q, "参数说明 scales", f"{scales.dtype}")
        if zero_points is not None:
            ok = zero_points.dtype in (torch.int8, torch.uint8, torch.int32, torch.bfloat16)
            _require(ok, op, _Q, "参数说明 zero_points", f"{zero_points.dtype}")
    else:
        # 参数说明 scales (div_mode False): "数据类型、数据格式需要和input的数据类型和数据格式一致"
        _require(
            scales.dtype == input.dtype, op, _Q, "参数说明 scales", f"scales {scales.dtype} != input {input.dtype}"
        )
        if zero_points is not None:
            # 参数说明 zero_points (div_mode False): "shape和dtype需要和scales一致"
            same = zero_points.dtype == scales.dtype and zero_points.shape == scales.shape
            _require(same, op, _Q, "参数说明 zero_points", "zero_points must match scales in shape and dtype")
        # 参数说明 axis: for div_mode False, axis > -2 means the last axis
        _require(axis >= -2, op, _Q, "参数说明 axis", f"axis {axis} (>= -2)")
        ax = input.dim() - 2 if axis == -2 else input.dim() - 1
        if scales.dim() == 1:
            # 参数说明 scales: 1-D size equal to input's axis dimension or 1
            ok = scales.numel() in (1, input.shape[ax])
            _require(
                ok, op, _Q, "参数说明 scales", f"1-D scales of size {scales.numel()} for axis size {input.shape[ax]}"
            )
    # 功能说明: result = input / scales + zero_points (div_mode True) or input * scales + zero_points
    xf = input.float()
    s = scales.float()
    v = xf / s if div_mode else xf * s
    if zero_points is not None:
        v = v + zero_points.float()
    return _round_int8(v)


# --- npu_quant_matmul --------------------------------------------------------------------------------
_QMM = "torch_npu-npu_quant_matmul.md"
_QMM_INNER_LIMIT = 65535

# 约束说明 表2 (Atlas A2/A3), int8 rows: (scale dtypes, offset allowed, bias dtypes, pertoken allowed/required, out)
_QMM_TABLE = (
    ({torch.int64, torch.float32}, False, {torch.int32, None}, "none", torch.float16),
    ({torch.int64, torch.float32}, True, {torch.int32, None}, "none", torch.int8),
    (
        {torch.float32, torch.bfloat16},
        False,
        {torch.int32, torch.bfloat16, torch.float32, None},
        "optional",
        torch.bfloat16,
    ),
    ({torch.float32}, False, {torch.int32, torch.bfloat16, torch.float32, None}, "required", torch.float16),
    ({torch.float32, torch.bfloat16}, False, {torch.int32, None}, "none", torch.int32),
)


def _decode_int64_scale(scale: torch.Tensor) -> torch.Tensor:
    # npu_trans_quant_param page 功能说明: out = (scale & 0xFFFFE000) | (1 << 46); the float32 bits sit in bits 0-31
    return (scale & 0xFFFFE000).to(torch.int32).view(torch.float32)


def npu_quant_matmul(
    x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None, group_sizes=None
):
    op = "npu_quant_matmul"
    _trace(op)
    # 约束说明: "传入的x1、x2、scale不能是空"
    _require(
        x1 is not None and x2 is not None and scale is not None, op, _QMM, "约束说明", "x1, x2, scale are required"
    )
    # 参数说明 x1/x2 (A2/A3): int8 (int32 = packed int4, not emulated); x2 "与x1的数据类型须保持一致"
    _require(x1.dtype == torch.int8 and x2.dtype == torch.int8, op, _QMM, "参数说明 x1/x2", f"{x1.dtype}, {x2.dtype}")
    # 参数说明 x1/x2: "shape需要在2-6维范围"
    _require(2 <= x1.dim() <= 6 and 2 <= x2.dim() <= 6, op, _QMM, "参数说明 x1/x2", "rank must be 2..6")
    _require(x1.shape[-1] == x2.shape[-2], op, _QMM, "功能说明", f"x1 {tuple(x1.shape)} @ x2 {tuple(x2.shape)}")
    # 约束说明: "x1与x2最后一维的shape大小不能超过65535"
    big = max(x1.shape[-1], x2.shape[-1])
    _require(big <= _QMM_INNER_LIMIT, op, _QMM, "约束说明", f"last dimension {big} exceeds 65535")
    n, m = x2.shape[-1], x1.shape[-2]
    # 参数说明 scale: 1-D (t,), t = 1 or n
    _require(scale.dim() == 1 and scale.numel() in (1, n), op, _QMM, "参数说明 scale", f"shape {tuple(scale.shape)}")
    if pertoken_scale is not None:
        # 参数说明 pertoken_scale: float32, 1-D (m,)
        ok = pertoken_scale.dtype == torch.float32 and tuple(pertoken_scale.shape) == (m,)
        _require(ok, op, _QMM, "参数说明 pertoken_scale", f"{pertoken_scale.dtype} {tuple(pertoken_scale.shape)}")
    if offset is not None:
        # 参数说明 offset: float32, 1-D (t,), t = 1 or n
        ok = offset.dtype == torch.float32 and offset.dim() == 1 and offset.numel() in (1, n)
        _require(ok, op, _QMM, "参数说明 offset", f"{offset.dtype} {tuple(offset.shape)}")
    if bias is not None:
        # 参数说明 bias: 1-D (n,) (3-D (batch, 1, n) for 3-D outputs)
        ok = (bias.dim() == 1 and bias.numel() == n) or (bias.dim() == 3 and x1.dim() == 3 and bias.shape[-1] == n)
        _require(ok, op, _QMM, "参数说明 bias", f"shape {tuple(bias.shape)} for n = {n}")
    # 参数说明 output_dtype: None means int8; A2/A3 allow int8, float16, bfloat16, int32 (no float32)
    out = torch.int8 if output_dtype is None else output_dtype
    _require(
        out in (torch.int8, torch.float16, torch.bfloat16, torch.int32), op, _QMM, "参数说明 output_dtype", f"{out}"
    )
    row_ok = False
    for scales, offset_ok, biases, pts, row_out in _QMM_TABLE:  # 约束说明 表2
        if (
            out == row_out
            and scale.dtype in scales
            and (offset is None or offset_ok)
            and (None if bias is None else bias.dtype) in biases
            and not (pts == "none" and pertoken_scale is not None)
            and not (pts == "required" and pertoken_scale is None)
        ):
            row_ok = True
            break
    combo = (
        f"scale {scale.dtype}, offset {None if offset is None else offset.dtype}, "
        f"bias {None if bias is None else bias.dtype}, "
        f"pertoken_scale {None if pertoken_scale is None else pertoken_scale.dtype}, output {out}"
    )
    _require(row_ok, op, _QMM, "约束说明 表2", f"dtype combination not in the table: {combo}")
    # 功能说明: out = (x1 @ x2 [+ int32 bias]) * scale [* pertoken] + offset, or x1 @ x2 * scale + float bias
    acc = x1.to(torch.int64) @ x2.to(torch.int64)
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.to(torch.int64)
    if out == torch.int32:
        return acc.to(torch.int32)
    s = _decode_int64_scale(scale) if scale.dtype == torch.int64 else scale
    y = acc.to(torch.float64) * s.to(torch.float64)
    if pertoken_scale is not None:
        y = y * pertoken_scale.to(torch.float64).unsqueeze(-1)
    if bias is not None and bias.dtype != torch.int32:
        y = y + bias.to(torch.float64)
    if offset is not None:
        y = y + offset.to(torch.float64)
    if out == torch.int8:
        return _round_int8(y)
    return y.to(out)


# --- npu_grouped_matmul ------------------------------------------------------------------------------
_GMM = "torch_npu-npu_grouped_matmul.md"
_GMM_INNER_LIMIT = 65536

# 约束说明 表2 (group_list Tensor, A2/A3), int8 full-quantization rows: (scale dtype, per_token_scale, output)
_GMM_TABLE = (
    (torch.int64, False, torch.int8),  # perchannel全量化
    (torch.bfloat16, False, torch.bfloat16),  # perchannel全量化
    (torch.float32, False, torch.float16),  # perchannel全量化
    (torch.bfloat16, True, torch.bfloat16),  # pertoken全量化
    (torch.float32, True, torch.float16),  # pertoken全量化
)


def npu_grouped_matmul(
    x,
    weight,
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list=None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    output_dtype=None,
    tuning_config=None,
):
    op = "npu_grouped_matmul"
    _trace(op)
    # Only the form this project uses is emulated: single x [M, K] int8, single weight [E, K, N] int8,
    # single output (约束说明 场景 "单单单": group_type 0, split_item 2 or 3, weight 3-D, x/y 2-D).
    _require(isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)), op, _GMM, "参数说明 x/weight", "lists")
    # 参数说明 x/weight: "列表最大长度为128"
    _require(len(x) <= 128 and len(weight) <= 128, op, _GMM, "参数说明 x/weight", "list longer than 128")
    if len(x) != 1 or len(weight) != 1 or group_type != 0:
        raise NotImplementedError(f"{op}: only the single-x / single-weight m-grouped form is emulated")
    for name, v in (("offset", offset), ("antiquant_scale", antiquant_scale), ("antiquant_offset", antiquant_offset)):
        if v is not None:
            raise NotImplementedError(f"{op}: {name} is not emulated")
    # 参数说明 activation_input / activation_quant_*: "当前仅支持传入None"
    for name, v in (("activation_input", activation_input), ("activation_quant_scale", activation_quant_scale)):
        _require(v is None, op, _GMM, f"参数说明 {name}", "must be None")
    _require(activation_quant_offset is None, op, _GMM, "参数说明 activation_quant_offset", "must be None")
    _require(act_type == 0, op, _GMM, "参数说明 act_type", "only 0 (no activation) is emulated")
    xt, wt = x[0], weight[0]
    # 约束说明 单单单: "仅支持split_item为2或3"; "weight中tensor需为3维，x、y中tensor需为2维"
    _require(split_item in (2, 3), op, _GMM, "约束说明 单单单", f"split_item {split_item} (2 or 3)")
    _require(
        xt.dim() == 2 and wt.dim() == 3, op, _GMM, "约束说明 单单单", f"x {tuple(xt.shape)}, weight {tuple(wt.shape)}"
    )
    floats = (torch.float16, torch.bfloat16, torch.float32)
    if xt.dtype in floats:
        return [_grouped_matmul_float(xt, wt, bias, scale, per_token_scale, group_list, group_list_type, output_dtype)]
    _require(
        xt.dtype == torch.int8 and wt.dtype == torch.int8, op, _GMM, "参数说明 x/weight", "int8 x int8 only emulated"
    )
    E, K, N = wt.shape
    _require(xt.shape[1] == K, op, _GMM, "功能说明", f"x [M, {xt.shape[1]}] against weight [E, K={K}, N]")
    # 约束说明: "x和weight中每一组tensor的最后一维大小都应小于InnerLimit" (65536 on A2/A3)
    _require(K < _GMM_INNER_LIMIT and N < _GMM_INNER_LIMIT, op, _GMM, "约束说明 InnerLimit", f"K={K}, N={N}")
    M = xt.shape[0]
    counts = _group_counts(group_list, group_list_type, E, M)
    # 参数说明 scale (group_list Tensor): float32, bfloat16, int64; one scale per group and output channel
    # ([E, N] for a single 3-D weight, as vllm-ascend's moe_mlp.py passes it).
    _require(scale is not None and len(scale) == 1, op, _GMM, "参数说明 scale", "one scale tensor for the one weight")
    st = scale[0]
    _require(tuple(st.shape) == (E, N), op, _GMM, "参数说明 scale", f"shape {tuple(st.shape)}, expected ({E}, {N})")
    pts = None
    if per_token_scale is not None:
        # 参数说明 per_token_scale: float32, 1-D, one per row of x
        _require(len(per_token_scale) == 1, op, _GMM, "参数说明 per_token_scale", "list length must match x")
        pts = per_token_scale[0]
        ok = pts.dtype == torch.float32 and tuple(pts.shape) == (M,)
        _require(ok, op, _GMM, "参数说明 per_token_scale", f"{pts.dtype} {tuple(pts.shape)}, expected float32 ({M},)")
    if bias is not None:
        # 约束说明 表2: the full-quantization rows take an int32 bias
        ok = len(bias) == 1 and bias[0].dtype == torch.int32 and tuple(bias[0].shape) == (E, N)
        _require(ok, op, _GMM, "约束说明 表2", "bias must be int32, one row per group")
    out = output_dtype
    row = (st.dtype, pts is not None, out)
    _require(
        row in _GMM_TABLE,
        op,
        _GMM,
        "约束说明 表2",
        f"scale {st.dtype}, per_token_scale {pts is not None}, output {out}",
    )
    # 功能说明 公式3-1: y_i = (x_i @ weight_i + bias_i) * scale_i * pertokenscale_i
    y = torch.empty(M, N, dtype=torch.float64)
    start = 0
    for e, c in enumerate(counts.tolist()):
        rows = slice(start, start + c)
        acc = xt[rows].to(torch.int64) @ wt[e].to(torch.int64)
        if bias is not None:
            acc = acc + bias[0][e].to(torch.int64)
        v = acc.to(torch.float64) * st[e].to(torch.float64)
        if pts is not None:
            v = v * pts[rows].to(torch.float64).unsqueeze(-1)
        y[rows] = v
        start += c
    if out == torch.int8:
        return [_round_int8(y)]
    return [y.to(out)]


def _group_counts(gl, group_list_type: int, E: int, M: int) -> torch.Tensor:
    op = "npu_grouped_matmul"
    # 参数说明 group_list: Tensor, 1-D, int64, one entry per group
    _require(isinstance(gl, torch.Tensor), op, _GMM, "参数说明 group_list", "must be a Tensor here")
    _require(
        gl.dtype == torch.int64 and gl.dim() == 1, op, _GMM, "参数说明 group_list", f"{gl.dtype} {tuple(gl.shape)}"
    )
    _require(gl.numel() == E, op, _GMM, "参数说明 group_list", f"{gl.numel()} entries for {E} groups")
    # 约束说明 单单单: "group_list第1维最大支持1024"
    _require(gl.numel() <= 1024, op, _GMM, "约束说明 单单单", "more than 1024 groups")
    if group_list_type == 0:
        # 参数说明 group_list: type 0 "必须为非负、单调非递减数列"; 单单单: "最后一个值与x中tensor的第一维相等"
        ok = bool((gl >= 0).all()) and bool((gl[1:] >= gl[:-1]).all())
        _require(ok, op, _GMM, "参数说明 group_list", "type 0 needs a non-negative, non-decreasing cumsum")
        _require(int(gl[-1]) == M, op, _GMM, "约束说明 单单单", f"last value {int(gl[-1])} != rows of x {M}")
        return torch.diff(gl, prepend=gl.new_zeros(1))
    if group_list_type == 1:
        # 参数说明 group_list: type 1 "必须为非负数列，且长度不能为1"; 单单单: "数值的总和与x中tensor的第一维相等"
        _require(bool((gl >= 0).all()), op, _GMM, "参数说明 group_list", "type 1 counts must be non-negative")
        _require(gl.numel() != 1, op, _GMM, "参数说明 group_list", "type 1 group_list may not have length 1")
        _require(int(gl.sum()) == M, op, _GMM, "约束说明 单单单", f"counts sum {int(gl.sum())} != rows of x {M}")
        return gl
    raise NotImplementedError(f"{op}: group_list_type {group_list_type} is not emulated")


def _grouped_matmul_float(xt, wt, bias, scale, per_token_scale, gl, group_list_type, output_dtype):
    """The 非量化 (float) rows of 约束说明 表2, single x / weight / y (单单单)."""
    op = "npu_grouped_matmul"
    # 约束说明 表2 非量化: x and weight of one dtype (float16, bfloat16, float32), y in that dtype,
    # no scale / per_token_scale (None); bias not emulated (this project passes none)
    _require(wt.dtype == xt.dtype, op, _GMM, "约束说明 表2 非量化", f"x {xt.dtype} with weight {wt.dtype}")
    _require(scale is None and per_token_scale is None, op, _GMM, "约束说明 表2 非量化", "scale must be None")
    out = xt.dtype if output_dtype is None else output_dtype
    # 参数说明 output_dtype: None means x's dtype; 表2 非量化: y has x's dtype
    _require(out == xt.dtype, op, _GMM, "约束说明 表2 非量化", f"output {out} for x {xt.dtype}")
    if bias is not None:
        raise NotImplementedError(f"{op}: bias on the float rows is not emulated")
    # 约束说明 单单单: "weight中tensor需为3维，x、y中tensor需为2维"; "x不支持转置"
    _require(xt.dim() == 2 and wt.dim() == 3, op, _GMM, "约束说明 单单单", f"x {tuple(xt.shape)}, w {tuple(wt.shape)}")
    _require(xt.is_contiguous(), op, _GMM, "约束说明 单单单", "x不支持转置 (x must not be a transposed view)")
    E, K, N = wt.shape
    _require(xt.shape[1] == K, op, _GMM, "功能说明", f"x [M, {xt.shape[1]}] against weight [E, K={K}, N]")
    # 约束说明: "x和weight中每一组tensor的最后一维大小都应小于InnerLimit" (65536 on A2/A3); for a transposed
    # weight (支持weight转置) its last dimension is K
    w_last = K if wt.stride(-2) == 1 and wt.stride(-1) != 1 else N
    _require(K < _GMM_INNER_LIMIT and w_last < _GMM_INNER_LIMIT, op, _GMM, "约束说明 InnerLimit", f"K={K}, N={N}")
    counts = _group_counts(gl, group_list_type, E, xt.shape[0])
    # 功能说明 非量化 (公式1): y_i = x_i @ weight_i; computed in float32 and rounded once (unverified: the
    # page gives the formula, not the accumulation precision)
    y = torch.empty(xt.shape[0], N, dtype=torch.float32)
    start = 0
    for e, c in enumerate(counts.tolist()):
        y[start : start + c] = xt[start : start + c].float() @ wt[e].float()
        start += c
    return y.to(out)


# --- npu_moe_init_routing_v2 -------------------------------------------------------------------------
_INIT = "torch_npu-npu_moe_init_routing_v2.md"
_INT32_MAX = 2**31 - 1


def npu_moe_init_routing_v2(
    x,
    expert_idx,
    *,
    scale=None,
    offset=None,
    active_num=-1,
    expert_capacity=-1,
    expert_num=-1,
    drop_pad_mode=0,
    expert_tokens_num_type=0,
    expert_tokens_num_flag=False,
    quant_mode=-1,
    active_expert_range=(),
    row_idx_type=0,
):
    op = "npu_moe_init_routing_v2"
    _trace(op)
    # Only the form this project uses is emulated: not quantized (quant_mode -1, no scale / offset),
    # dropless (drop_pad_mode 0), counts or cumsum requested (expert_tokens_num_flag, type 0 or 1).
    if quant_mode != -1 or scale is not None or offset is not None:
        raise NotImplementedError(f"{op}: only quant_mode -1 without scale / offset is emulated")
    if drop_pad_mode != 0:
        raise NotImplementedError(f"{op}: only the dropless form (drop_pad_mode 0) is emulated")
    if not expert_tokens_num_flag or expert_tokens_num_type == 2:
        raise NotImplementedError(f"{op}: only expert_tokens_num_flag True with type 0 or 1 is emulated")
    # 参数说明 x: "要求为2维张量，shape为(NUM_ROWS, H)。数据类型支持float16、bfloat16、float32、int8"
    ok = x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int8)
    _require(ok, op, _INIT, "参数说明 x", f"x {x.dtype} {tuple(x.shape)} (2-D float16/bfloat16/float32/int8)")
    # 参数说明 expert_idx: "要求是2维张量，shape为(NUM_ROWS, K)" ... "数据类型支持int32"
    ok = expert_idx.dim() == 2 and expert_idx.shape[0] == x.shape[0] and expert_idx.dtype == torch.int32
    _require(
        ok, op, _INIT, "参数说明 expert_idx", f"{expert_idx.dtype} {tuple(expert_idx.shape)} for x rows {x.shape[0]}"
    )
    # 参数说明 expert_tokens_num_type: 0 (cumsum), 1 (count), 2 (key_value)
    _require(
        expert_tokens_num_type in (0, 1), op, _INIT, "参数说明 expert_tokens_num_type", f"{expert_tokens_num_type}"
    )
    # 参数说明 expert_num: "其他模式取值范围为[0, 10240]" (outside key_value mode)
    _require(0 <= expert_num <= 10240, op, _INIT, "参数说明 expert_num", f"{expert_num} outside [0, 10240]")
    # 参数说明 active_num: "在dropless场景下，取值需大于等于-1"
    _require(active_num >= -1, op, _INIT, "参数说明 active_num", f"{active_num} (>= -1 in the dropless form)")
    # 参数说明 active_expert_range: [expert_start, expert_end), "要求值大于等于0，并且expert_end不大于expert_num";
    # "传入默认值时，视为活跃的expert范围在0到expert_num之间"
    rng = list(active_expert_range) or [0, expert_num]
    ok = len(rng) == 2 and 0 <= rng[0] < rng[1] <= expert_num
    _require(ok, op, _INIT, "参数说明 active_expert_range", f"{rng} for expert_num {expert_num}")
    start, end = rng
    # 参数说明 row_idx_type: 0 (gather index) or 1 (scatter index)
    _require(row_idx_type in (0, 1), op, _INIT, "参数说明 row_idx_type", f"{row_idx_type}")
    ids = expert_idx.long().reshape(-1)
    # 参数说明 expert_idx: "专家id不能超过专家数"
    _require(
        bool((ids < expert_num).all()), op, _INIT, "参数说明 expert_idx", f"an expert id >= expert_num {expert_num}"
    )
    n, k = expert_idx.shape
    # 功能说明 1: sortedExpertIdx, sortedRowIdx = keyValueSort(expertIdx, rowIdx); 等价计算逻辑: a stable sort,
    # ids below expert_start sorted last (as INT32_MAX)
    key = torch.where(ids < start, torch.full_like(ids, _INT32_MAX), ids)
    sorted_key, sorted_row = torch.sort(key, stable=True)
    # 功能说明 6: availableIdxNum = |{x in expertIdx | expert_start <= x < expert_end}|
    avail = int(((ids >= start) & (ids < end)).sum())
    # 功能说明 2 and 返回值说明 expanded_row_idx: int32 (NUM_ROWS*K,); type 1 (scatter): [i] = sortedRowIdx[i],
    # the first availableIdxNum valid ("无效数据未初始化": -1 here, unverified); type 0 (gather):
    # [sortedRowIdx[i]] = i, "无效数据由-1填充"
    row_idx = torch.full((n * k,), -1, dtype=torch.int64)
    if row_idx_type == 1:
        row_idx[:avail] = sorted_row[:avail]
    else:
        row_idx[sorted_row[:avail]] = torch.arange(avail)
    # 功能说明 3 and 返回值说明 expert_token_cumsum_or_count: int64, one per expert of the active range
    counts = torch.bincount(sorted_key[:avail] - start, minlength=end - start)
    tokens = counts.cumsum(0) if expert_tokens_num_type == 0 else counts
    # 返回值说明 expanded_x: [NUM_ROWS*K, H] (active_num -1 or 0), [min(active_num, NUM_ROWS*K), H] (Active);
    # 功能说明 5: expandedXOut[i] = x[sortedRowIdx[i] // K] for the available rows. The other rows are not
    # described: NaN here (0 for int8), so that a caller relying on them shows (unverified).
    rows = n * k if active_num in (-1, 0) else min(active_num, n * k)
    fill = float("nan") if x.dtype.is_floating_point else 0
    expanded = torch.full((rows, x.shape[1]), fill, dtype=x.dtype)
    m = min(avail, rows)
    expanded[:m] = x[sorted_row[:m] // k]
    # 返回值说明 expanded_scale: float32, "expert_idx的shape去掉最后一维之后所有维度的乘积" elements; without scale
    # in the unquantized form "输出expanded_scale中的值无意义" (参数说明 scale): NaN here
    expanded_scale = torch.full((n,), float("nan"), dtype=torch.float32)
    return expanded, row_idx.to(torch.int32), tokens.to(torch.int64), expanded_scale


# --- npu_moe_token_unpermute -------------------------------------------------------------------------
# torch_npu documents this operator only in a docstring (op-plugin codegen/templates/_op_plugin_docs.py,
# "npu_moe_token_unpermute"), which gives bfloat16 only and int64 indices; torch_npu passes its tensors
# straight to aclnnMoeTokenUnpermute (op_plugin/ops/opapi/MoeTokenUnpermuteKernelNpuOpApi.cpp), whose page
# gives bfloat16/float16/float32 and int32 indices (the indices op-plugin's own test and vllm-ascend pass).
# The rules below are that page's.
_CANN_DOCS = "ops-transformer moe/moe_token_unpermute/docs/"
_UNPERMUTE = "aclnnMoeTokenUnpermute.md"


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    op = "npu_moe_token_unpermute"
    _trace(op)
    floats = (torch.bfloat16, torch.float16, torch.float32)

    def req(ok, section, message):
        _require(ok, op, _UNPERMUTE, section, message, docs=_CANN_DOCS)

    # 参数说明 paddedMode: "目前仅支持false"; restoreShapeOptional: "目前仅支持nullptr"
    req(padded_mode is False, "参数说明 paddedMode", "only False is supported")
    req(restore_shape is None, "参数说明 restoreShapeOptional", "only None is supported")
    # 参数说明 permutedTokens: BFLOAT16, FLOAT16, FLOAT32; 2-D (tokens_num * topK_num, hidden_size)
    ok = permuted_tokens.dtype in floats and permuted_tokens.dim() == 2
    req(ok, "参数说明 permutedTokens", f"{permuted_tokens.dtype} rank {permuted_tokens.dim()} (2-D float)")
    # 参数说明 probsOptional: BFLOAT16, FLOAT16, FLOAT32, (tokens_num, topK_num); "当probs不传时，topK_num=1"
    if probs is not None:
        req(probs.dtype in floats and probs.dim() == 2, "参数说明 probsOptional", f"{probs.dtype} rank {probs.dim()}")
        tokens_num, top_k = probs.shape
    else:
        tokens_num, top_k = permuted_tokens.shape[0], 1
    # 约束说明 (Atlas A2/A3): "topK_num <= 512"
    req(top_k <= 512, "约束说明", f"topK_num {top_k} > 512")
    rows = permuted_tokens.shape[0]
    req(
        rows == tokens_num * top_k, "参数说明 permutedTokens", f"{rows} rows for {tokens_num} tokens x topK_num {top_k}"
    )
    # 参数说明 sortedIndices: INT32, 1-D (tokens_num * topK_num), "取值范围是[0, tokens_num * topK_num - 1]，且没有重复索引"
    ok = sorted_indices.dtype == torch.int32 and tuple(sorted_indices.shape) == (tokens_num * top_k,)
    req(
        ok,
        "参数说明 sortedIndices",
        f"{sorted_indices.dtype} {tuple(sorted_indices.shape)}, int32 ({tokens_num * top_k},)",
    )
    idx = sorted_indices.long()
    in_range = idx.numel() == 0 or (int(idx.min()) >= 0 and int(idx.max()) < tokens_num * top_k)
    req(in_range, "参数说明 sortedIndices", f"values outside [0, {tokens_num * top_k - 1}]")
    req(idx.unique().numel() == idx.numel(), "参数说明 sortedIndices", "repeated indices")
    # 功能说明: T[k] = T[S[k]]; T[k] = T[k] * P[i][j]; O[i] = sum_{k = i*topK}^{(i+1)*topK - 1} T[k]; out in
    # permutedTokens' dtype (参数说明 out). Computed in float32 and rounded once (unverified: the page gives the
    # formula, not the precision).
    t = permuted_tokens.float().index_select(0, idx).reshape(tokens_num, top_k, -1)
    if probs is not None:
        t = t * probs.float().unsqueeze(-1)
    return t.sum(dim=1).to(permuted_tokens.dtype)


# --- npu_swiglu --------------------------------------------------------------------------------------
_SWIGLU = "（beta）torch_npu-npu_swiglu.md"


def npu_swiglu(input, dim=-1):
    op = "npu_swiglu"
    _trace(op)
    # 参数说明 input: float32, float16, bfloat16; 1-8 dims; even along dim; no empty tensor
    _require(
        input.dtype in (torch.float32, torch.float16, torch.bfloat16), op, _SWIGLU, "参数说明 input", f"{input.dtype}"
    )
    _require(1 <= input.dim() <= 8, op, _SWIGLU, "参数说明 input", f"rank {input.dim()}")
    _require(input.numel() > 0, op, _SWIGLU, "参数说明 input", "empty tensor")
    _require(input.shape[dim] % 2 == 0, op, _SWIGLU, "参数说明 input", f"dim {dim} of size {input.shape[dim]} is odd")
    # 功能说明: swiglu(x) = A * sigmoid(A) * B, A the first half along dim, B the second; output in input's dtype
    a, b = input.float().chunk(2, dim=dim)
    return (a * torch.sigmoid(a) * b).to(input.dtype)


# --- npu_clipped_swiglu ------------------------------------------------------------------------------
_CLIPPED = "torch_npu-npu_clipped_swiglu.md"


def npu_clipped_swiglu(x, *, group_index=None, dim=-1, alpha=1.702, limit=7.0, bias=1.0, interleaved=True):
    op = "npu_clipped_swiglu"
    _trace(op)
    # 参数说明 x: float16, bfloat16, float32; "不支持非连续的Tensor"; "维数必须大于1维且第dim轴的元素数量为偶数"
    _require(x.dtype in (torch.float16, torch.bfloat16, torch.float32), op, _CLIPPED, "参数说明 x", f"{x.dtype}")
    _require(x.is_contiguous(), op, _CLIPPED, "参数说明 x", "non-contiguous tensor")
    _require(x.dim() > 1, op, _CLIPPED, "参数说明 x", f"rank {x.dim()} (more than 1 needed)")
    _require(x.shape[dim] % 2 == 0, op, _CLIPPED, "参数说明 x", f"dim {dim} of size {x.shape[dim]} is odd")
    # 参数说明 dim: range [-x.dim(), x.dim() - 1]
    _require(-x.dim() <= dim < x.dim(), op, _CLIPPED, "参数说明 dim", f"dim {dim} for rank {x.dim()}")
    if group_index is not None:
        raise NotImplementedError(f"{op}: group_index is not emulated (this project does not pass it)")
    # 功能说明 steps 3-4: split (odd/even or front/back), A.clamp(max=limit), B.clamp(-limit, limit),
    # y = A * sigmoid(alpha * A) * (B + bias); 返回值说明: y in x's dtype, dim halved
    xf = x.float().movedim(dim, -1)
    a, b = (xf[..., 0::2], xf[..., 1::2]) if interleaved else xf.chunk(2, dim=-1)
    a = a.clamp(max=limit)
    b = b.clamp(min=-limit, max=limit)
    y = a * torch.sigmoid(alpha * a) * (b + bias)
    return y.movedim(-1, dim).to(x.dtype)


# --- npu_gather_sparse_index -------------------------------------------------------------------------
_GATHER = "torch_npu-npu_gather_sparse_index.md"
_GATHER_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.float64, torch.complex64, torch.complex128,
)  # fmt: skip


def npu_gather_sparse_index(input, index):
    op = "npu_gather_sparse_index"
    _trace(op)
    # 参数说明 input: the dtypes listed; index: int64 or int32, at most 7 dims, values in [0, input.shape[0] - 1]
    _require(input.dtype in _GATHER_DTYPES, op, _GATHER, "参数说明 input", f"{input.dtype}")
    _require(index.dtype in (torch.int64, torch.int32), op, _GATHER, "参数说明 index", f"{index.dtype}")
    _require(index.dim() <= 7, op, _GATHER, "参数说明 index", f"rank {index.dim()} (at most 7)")
    ok = index.numel() == 0 or (int(index.min()) >= 0 and int(index.max()) <= input.shape[0] - 1)
    _require(ok, op, _GATHER, "参数说明 index", f"values outside [0, {input.shape[0] - 1}] (no negative indices)")
    # 约束说明: "index.dim + input.dim - 1 <= 8"
    _require(index.dim() + input.dim() - 1 <= 8, op, _GATHER, "约束说明", "index.dim + input.dim - 1 > 8")
    # 功能说明: y[i, j] = x[idx[i], j]; 返回值说明: shape index.shape + input.shape[1:], input's dtype
    return input.index_select(0, index.reshape(-1).long()).view(*index.shape, *input.shape[1:])


# --- npu_rotary_mul ----------------------------------------------------------------------------------
_ROPE = "torch_npu-npu_rotary_mul.md"


def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):
    op = "npu_rotary_mul"
    _trace(op)
    floats = (torch.float32, torch.float16, torch.bfloat16)
    # 参数说明 input/r1/r2: 3-D or 4-D, float16/bfloat16/float32
    for name, t in (("input", input), ("r1", r1), ("r2", r2)):
        _require(t.dtype in floats and t.dim() in (3, 4), op, _ROPE, f"参数说明 {name}", f"{t.dtype} rank {t.dim()}")
    _require(rotary_mode in ("half", "interleave"), op, _ROPE, "参数说明 rotary_mode", f"{rotary_mode!r}")
    if rotate is not None:
        raise NotImplementedError(f"{op}: rotate is not emulated")
    d = input.shape[-1]
    # 约束说明 (jit_compile=False): D < 896 and even
    _require(d < 896 and d % 2 == 0, op, _ROPE, "约束说明", f"D = {d}")
    # 约束说明: r1, r2 数据范围 [-1, 1]
    for name, t in (("r1", r1), ("r2", r2)):
        _require(bool((t.float().abs() <= 1).all()), op, _ROPE, "约束说明", f"{name} outside [-1, 1]")
    if rotary_mode == "interleave" and input.dim() == 4:
        # 约束说明 interleave: r1/r2 layout 11SD (BNSD), 1S1D (BSND) or S11D (SBND) of input's S and D; B*N < 1000
        a, b, c, _ = input.shape
        shapes = {(1, 1, c, d): a * b, (1, b, 1, d): a * c, (a, 1, 1, d): b * c}
        ok = tuple(r1.shape) in shapes and tuple(r2.shape) == tuple(r1.shape)
        _require(
            ok,
            op,
            _ROPE,
            "约束说明 interleave",
            f"r1 {tuple(r1.shape)} is not a layout allowed for {tuple(input.shape)}",
        )
        _require(shapes[tuple(r1.shape)] < 1000, op, _ROPE, "约束说明 interleave", "B*N must be < 1000")
    # 功能说明: output = x * cos + rotate(x) * sin; output shape and dtype as input
    x = input.float()
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rot = torch.cat((-x2, x1), dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
        rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return (x * r1.float() + rot * r2.float()).to(input.dtype)


# --- installing it -----------------------------------------------------------------------------------
def as_module() -> types.ModuleType:
    """This emulator as a module object named ``torch_npu``."""
    import importlib.machinery

    mod = types.ModuleType("torch_npu", __doc__)
    # a spec like an imported module's: torch.compile asks importlib.util.find_spec("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    for name in __all__:
        setattr(mod, name, globals()[name])
    return mod


def install() -> types.ModuleType:
    """Put the emulator into ``sys.modules['torch_npu']`` of this process (tests only)."""
    mod = as_module()
    sys.modules["torch_npu"] = mod
    return mod


# vLLM's CPU attention runs its AMX kernel for bfloat16 wherever the CPU has AMX tiles, but never asks
# Linux for AMX permission (arch_prctl ARCH_REQ_XCOMP_PERM); oneDNN asks on its first AMX GEMM, which in
# a bfloat16 serve comes before the first attention call. Under the emulator the linears run the
# emulated torch_npu kernels instead, nothing asks, and on an AMX machine the worker dies with SIGILL
# in its first attention call. So every process of an emulated engine asks at start-up, as oneDNN would.
AMX_PERMISSION = "import torch\n\nif torch.cpu._is_amx_tile_supported():\n    torch.cpu._init_amx()\n"


def write_shim(folder: Path) -> Path:
    """Write a ``torch_npu`` package into ``folder`` that re-exports this emulator, and a
    ``sitecustomize`` that asks for AMX permission (see ``AMX_PERMISSION``); put ``folder`` first on
    ``PYTHONPATH`` of a test server. Returns ``folder``."""
    (Path(folder) / "sitecustomize.py").parent.mkdir(parents=True, exist_ok=True)
    (Path(folder) / "sitecustomize.py").write_text(AMX_PERMISSION)  # run by every Python process started there
    pkg = Path(folder) / "torch_npu"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(
        '"""CONTRACT EMULATOR of torch_npu for tests (ascend_adapters.testing.npu_emulator): not an NPU."""\n'
        "from ascend_adapters.testing.npu_emulator import *  # noqa: F401,F403\n"
        "from ascend_adapters.testing.npu_emulator import IS_CONTRACT_EMULATOR  # noqa: F401\n"
    )
    return Path(folder)


def served_env(folder: Path):
    """The environment that serves a model on the NPU kernel path through this emulator (its shim first on
    ``PYTHONPATH``, ``ASCEND_ADAPTERS_NPU_EMULATOR=1``, calls traced under ``folder``), and a function that
    lists the torch_npu operators the server's processes called."""
    import os

    from ascend_adapters.common.platform import EMULATOR_ENV

    shim, trace = write_shim(Path(folder) / "shim"), Path(folder) / "trace"
    trace.mkdir(parents=True, exist_ok=True)
    env = {
        "PYTHONPATH": os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")]),
        EMULATOR_ENV: "1",
        TRACE_ENV: str(trace),
    }
    return env, lambda: sorted({p.name.split("-", 1)[1] for p in trace.iterdir()})


__all__ = [
    "IS_CONTRACT_EMULATOR",
    "NpuContractError",
    "npu_dynamic_quant",
    "npu_quantize",
    "npu_quant_matmul",
    "npu_grouped_matmul",
    "npu_moe_init_routing_v2",
    "npu_moe_token_unpermute",
    "npu_swiglu",
    "npu_clipped_swiglu",
    "npu_rotary_mul",
    "npu_gather_sparse_index",
]
