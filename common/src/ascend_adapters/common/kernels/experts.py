"""Routed experts with fixed shapes and no host read: routing, grouping and combining on the device.

A route is one (token, slot) of the router's ``topk_ids [T, k]`` (global expert ids; negative: no
route). ``expert_map [E_global]`` maps a global id to this rank's local id (-1: another rank).

On an NPU each op is a kernel launch and vllm-ascend captures whole decode steps as graphs, so the
experts read nothing on the host (no ``.tolist()``, ``.item()``, boolean-mask indexing, ``nonzero``)
and dispatch the same op sequence whatever the batch size and whichever experts got tokens; every
shape below follows from T, k, E and the weights alone:

* ``sort_routes`` sorts all R = T*k routes by local expert on the device (a stable sort: routes keep
  their token order inside an expert). The routes of no local expert (another rank's, or negative)
  sort last and join the last local expert's group, so the groups always cover the R rows: those
  rows are computed and dropped (their combine row is a trash row T). The cumulative group sizes
  come from ``searchsorted`` over the sorted keys.
* ``grouped_experts`` gathers the R rows in that order, runs ``experts(rows, routes)`` once over all
  of them (the float and W8A8 kernels: one grouped GEMM per projection) and adds each output row,
  times its router weight, into its token's row (``index_add_``, in route order).

``grouped_experts_reference`` is the independent check: one route at a time, in float64.

``common.swiglu_experts`` is the float MoE of this shape: ``w13 [E, 2I, H]`` (gate rows then up
rows), ``w2 [E, H, I]``, SwiGLU (optionally clamped) between them. Portable: one
``torch._grouped_mm`` per projection (m-grouped, ``offs`` the cumulative group sizes). Its operands
need strides that are multiples of 16 bytes; ``grouped_mm`` zero-pads the contraction dimension to
that where it is not (some test shapes; the tiny checkpoints here have H = 128 and I = 32 or 64, 16
or 32 per rank at TP=2, aligned in every float dtype), which adds only zero products.
NPU twin, as vllm-ascend's all-gather dispatcher does it (``vllm_ascend/ops/fused_moe/
token_dispatcher.py``, ``TokenDispatcherWithAllGather``): ``npu_moe_init_routing_v2`` sorts and
expands the rows and counts them per expert, one ``npu_grouped_matmul`` per projection (m-grouped,
single tensors, cumulative ``group_list``), and ``npu_moe_token_unpermute`` weights and sums each
token's rows back (vllm-ascend's choice over ``npu_moe_finalize_routing``, which it reports
inaccurate). The routes of no local expert go to one dummy expert E after the local ones and are
weighted 0 in the combine (each is a real token's row, finite, so it adds 0); their rows join the
last local expert's group, because
``npu_grouped_matmul`` wants the group sizes to sum to the rows of x (npu_grouped_matmul.md 约束说明
单单单 rule 3). Under expert parallelism over N ranks that computes about (N - 1) / N of the rows
for nothing; vllm-ascend instead passes counts that sum to fewer rows than x has, which the page
does not allow, so this project does not until it is verified on an NPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ascend_adapters.common import compat, dispatch
from ascend_adapters.common.kernels.activation import swiglu, swiglu_npu


def local_routes(topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Global expert ids -> local expert ids; -1 for negative routes and experts not on this rank."""
    ids = topk_ids.long()
    valid = ids >= 0
    if expert_map is not None:
        safe = torch.where(valid, ids, torch.zeros_like(ids)).clamp_(max=expert_map.numel() - 1)
        local = expert_map.long()[safe]
        local = torch.where(valid & (ids < expert_map.numel()), local, torch.full_like(local, -1))
    else:
        local = torch.where(valid & (ids < num_local_experts), ids, torch.full_like(ids, -1))
    return local


@dataclass(frozen=True)
class Routes:
    """All R = T*k routes sorted by local expert, every tensor of a fixed shape.

    ``tokens [R]``: the token of each sorted row; ``experts [R]``: its group (its local expert; the
    last one for a route of no local expert); ``dest [R]``: its combine row (its token, or the trash
    row T for a route of no local expert); ``weights [R]``: its router weight, float32;
    ``offsets [E]``: int32 cumulative group sizes, ``offsets[-1] == R``.
    """

    tokens: torch.Tensor
    experts: torch.Tensor
    dest: torch.Tensor
    weights: torch.Tensor
    offsets: torch.Tensor


def sort_routes(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None
) -> Routes:
    """This rank's view of all T*k routes, sorted by local expert on the device (``Routes``)."""
    t, k = topk_ids.shape[0], topk_ids.shape[-1]
    e = num_local_experts
    local = local_routes(topk_ids.reshape(t, k), e, expert_map).reshape(-1)
    key = torch.where(local >= 0, local, torch.full_like(local, e))  # no local expert: after every group
    key, order = torch.sort(key, stable=True)
    # group g ends after the last key <= g; the last group ends at R (it also takes the key-E rows)
    bounds = torch.arange(e, device=key.device)
    bounds[-1] = e
    offsets = torch.searchsorted(key, bounds, right=True, out_int32=True)
    tokens = torch.div(order, k, rounding_mode="floor")
    dest = torch.where(key < e, tokens, torch.full_like(tokens, t))
    weights = topk_weights.reshape(-1).float().index_select(0, order)
    return Routes(tokens, key.clamp(max=e - 1), dest, weights, offsets)


def grouped_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: Callable[[torch.Tensor, Routes], torch.Tensor],
    *,
    num_experts: int,
    expert_map: torch.Tensor | None = None,
    weight_on_input: bool = False,
    acc_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``sum over routes of w * expert(e, x[token])`` per token, ``[T, H_out]`` in x.dtype.

    ``experts(rows, routes)`` maps the R gathered rows (sorted: row i belongs to local expert
    ``routes.experts[i]``, the groups delimited by ``routes.offsets``) to their R output rows, all
    at once. The sum is accumulated in ``acc_dtype`` (default x.dtype): each output row and its
    router weight are cast to it before the product. ``weight_on_input`` scales the rows (in
    float32, rounded to x.dtype) instead.
    """
    acc = acc_dtype or x.dtype
    t = x.shape[0]
    if t == 0:
        return torch.zeros(0, x.shape[-1], dtype=x.dtype, device=x.device)
    routes = sort_routes(topk_weights, topk_ids, num_experts, expert_map)
    rows = x.index_select(0, routes.tokens)
    if weight_on_input:
        rows = (rows.float() * routes.weights[:, None]).to(x.dtype)
    y = experts(rows, routes).to(acc)
    if not weight_on_input:
        y = y * routes.weights[:, None].to(acc)
    out = torch.zeros(t + 1, y.shape[-1], dtype=acc, device=x.device)
    out.index_add_(0, routes.dest, y)
    return out[:t].to(x.dtype)


def grouped_experts_reference(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
    *,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """One route at a time: ``out[t] += w[t, j] * expert(local(ids[t, j]), x[t])``, in float64."""
    out = torch.zeros(x.shape[0], x.shape[-1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[-1]):
            g = int(topk_ids[t, j])
            if g < 0:
                continue
            e = g if expert_map is None else (int(expert_map[g]) if g < expert_map.numel() else -1)
            if e < 0:
                continue
            out[t] += float(topk_weights[t, j]) * expert(e, x[t : t + 1]).double()[0]
    return out


def grouped_mm(rows: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``rows [R, K] @ w[g].T`` for each group g of rows (``offsets``: int32 cumulative sizes), ``w [E, N, K]``.

    One ``torch._grouped_mm`` (float32, bfloat16, float16). It needs strides that are multiples of
    16 bytes: the contraction dimension K of both operands is zero-padded to that where it is not
    (zero products, so the same sums), and the weight is passed as the transposed view of ``[E, N, K]``.
    """
    unit = 16 // rows.element_size()
    pad = -rows.shape[-1] % unit
    if pad:
        rows, w = F.pad(rows, (0, pad)), F.pad(w, (0, pad))
    return torch._grouped_mm(rows.contiguous(), w.contiguous().transpose(1, 2), offs=offsets)


@dataclass(frozen=True)
class NpuRoutes:
    """``npu_moe_init_routing_v2``'s routing of all R = T*k routes over this rank's E experts and one
    dummy expert E (the routes of no local expert). ``rows [R, H]``: x's rows sorted by expert, the
    dummy's last; ``row_idx [R]`` int32: the sorted position of route ``t*k + j`` (the gather index,
    row_idx_type 0, which ``npu_moe_token_unpermute`` takes); ``group_list [E]`` int64: cumulative
    group sizes with the dummy's rows in the last group, so ``group_list[-1] == R``; ``local [T, k]``:
    whether the route is to an expert of this rank."""

    rows: torch.Tensor
    row_idx: torch.Tensor
    group_list: torch.Tensor
    local: torch.Tensor


def npu_sort_routes(
    torch_npu, x: torch.Tensor, topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None
) -> NpuRoutes:
    """(``torch_npu``: the module, imported by the NPU twin that calls this.)"""
    t, k = topk_ids.shape[0], topk_ids.shape[-1]
    e = num_local_experts
    local = local_routes(topk_ids.reshape(t, k), e, expert_map)
    # local ids, and the dummy expert e for the rest: arbitrary expert maps (not only one contiguous
    # global range per rank, which is what vllm-ascend's active_expert_range expresses) and negative ids
    ids = torch.where(local >= 0, local, torch.full_like(local, e)).to(torch.int32)
    # npu_moe_init_routing_v2.md: dropless (drop_pad_mode 0), not quantized (quant_mode -1), every expert
    # active (active_expert_range [0, expert_num]: every row of expanded_x is defined), cumulative counts
    rows, row_idx, cumsum, _ = torch_npu.npu_moe_init_routing_v2(
        x,
        ids,
        active_num=t * k,
        expert_num=e + 1,
        expert_tokens_num_type=0,
        expert_tokens_num_flag=True,
        quant_mode=-1,
        active_expert_range=[0, e + 1],
        row_idx_type=0,
    )
    # drop the last local expert's end: its group runs on to R, over the dummy's rows. group_list_type 0
    # (cumulative) is valid for any number of experts; type 1 "may not have length 1"
    # (npu_grouped_matmul.md 参数说明 group_list).
    group_list = torch.cat([cumsum[: e - 1], cumsum[e:]])
    return NpuRoutes(rows, row_idx, group_list, local >= 0)


def npu_combine(torch_npu, y: torch.Tensor, routes: NpuRoutes, probs: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j probs[t, j] * y[row_idx[t*k + j]]`` with the routes of no local expert weighted 0:
    ``npu_moe_token_unpermute`` (probs cast to y's dtype), ``[T, H]`` in y's dtype."""

    probs = torch.where(routes.local, probs, torch.zeros_like(probs)).to(y.dtype)
    return torch_npu.npu_moe_token_unpermute(y, routes.row_idx, probs=probs)


def swiglu_expert_reference(w13: torch.Tensor, w2: torch.Tensor, limit: float | None):
    """``expert(e, rows)`` of the float SwiGLU MoE, in float64 (for ``grouped_experts_reference``)."""
    from ascend_adapters.common.kernels.activation import swiglu_reference

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        return swiglu_reference(rows.double() @ w13[e].double().t(), limit) @ w2[e].double().t()

    return expert


@dispatch.portable("common.swiglu_experts")
def swiglu_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    limit: float | None = None,
) -> torch.Tensor:
    """Float routed experts: this rank's ``w13 [E, 2I, H]`` / ``w2 [E, H, I]``; this rank's partial sum.

    One grouped GEMM per projection over all T*k routes; the sum in x's dtype."""

    def experts(rows: torch.Tensor, routes: Routes) -> torch.Tensor:
        h = swiglu(grouped_mm(rows, w13, routes.offsets), limit)
        return grouped_mm(h, w2, routes.offsets)

    return grouped_experts(x, topk_weights, topk_ids, experts, num_experts=w13.shape[0], expert_map=expert_map)


@dispatch.npu("common.swiglu_experts")
def swiglu_experts_npu(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    limit: float | None = None,
) -> torch.Tensor:
    import torch_npu

    t, k = topk_ids.shape[0], topk_ids.shape[-1]
    if t == 0:
        return torch.zeros_like(x)
    routes = npu_sort_routes(torch_npu, x, topk_ids, w13.shape[0], expert_map)

    def gmm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # 表2 非量化 rows: x and weight of one float dtype, y in it; 单单单 场景: weight [E, K, N] (a
        # transposed view is allowed: "支持weight转置"), split_item 2, group_type 0.
        return torch_npu.npu_grouped_matmul(
            [a], [w.transpose(1, 2)], group_list=routes.group_list, split_item=2, group_type=0, group_list_type=0
        )[0]

    h = swiglu_npu(gmm(routes.rows, w13), limit)
    return npu_combine(torch_npu, gmm(h, w2), routes, topk_weights.reshape(t, k).float())


# -- on vLLM-CPU: the engine's oneDNN GEMM per expert ----------------------------------------------
# torch's CPU ``_grouped_mm`` multiplies each group with ``mm`` (MKL here), which at decode sizes (a few
# rows per expert) streams an expert's weights once per row: measured on a 2-core AVX2 EPYC, 16 experts
# of [4096, 4096] float32 took 53, 159 and 243 ms at 1, 3 and 16 rows each, vLLM-CPU's prepacked oneDNN
# GEMM 44, 50 and 94 ms. vLLM's own CPU MoE kernel cannot serve DeepSeek-V4's clamped SwiGLU (it
# ignores ``swiglu_limit``), so on vLLM-CPU the float experts keep this module's routing and combine
# and run each expert's rows through the engine's GEMM, one prepacked handle per expert and projection.
# The groups' bounds are read on the host: on the CPU the tensors live there (no device sync), and
# this path never serves an accelerator (the NPU twin does; graph and op-count tests pin the portable
# op, ``PORTABLE_EXPERTS_ENV``).

ENGINE_EXPERTS = "vllm-cpu onednn"  # dispatch.choose label
PORTABLE_EXPERTS_ENV = "ASCEND_ADAPTERS_PORTABLE_EXPERTS"  # on: the portable op on the CPU too


class EngineSwigluExperts:
    """Float routed experts held only as vLLM-CPU's prepacked oneDNN handles (``w13 [E, 2I, H]``,
    ``w2 [E, H, I]`` copied into the engine's layout, so the caller may release them, as vLLM's CPU
    linears do). ``handles13`` / ``handles2``: ``[E]`` int64, each expert's handle."""

    def __init__(self, ops, w13: torch.Tensor, w2: torch.Tensor):
        self.width13, self.hidden = w13.shape[1], w2.shape[1]
        # the handle objects release their oneDNN primitive when collected: kept for the layer's life
        self._handles = [[ops.create_onednn_mm(w[e].t()) for e in range(w.shape[0])] for w in (w13, w2)]
        self.handles13, self.handles2 = (torch.stack([h.handler_tensor for h in hs]) for hs in self._handles)
        self.nbytes = (w13.numel() + w2.numel()) * w13.element_size()

    def __call__(self, x, topk_weights, topk_ids, expert_map, limit):
        """The routed experts' partial sum, as ``common.swiglu_experts`` (one opaque op for vLLM's compile)."""
        return torch.ops.vllm.ascend_adapters_engine_swiglu_experts(
            x, self.handles13, self.handles2, self.width13, self.hidden, topk_weights, topk_ids, expert_map, limit
        )


def engine_swiglu_experts(w13: torch.Tensor, w2: torch.Tensor) -> EngineSwigluExperts | str:
    """The engine path for these weights, or why it does not serve (``dispatch.choose``'s candidate)."""
    if w13.device.type != "cpu":
        return "not on the CPU"
    ops = compat.cpu_float_gemm()
    if ops is None:
        return "this engine build has no oneDNN float GEMM"
    try:  # oneDNN builds a primitive per dtype and ISA: bfloat16 has none on an AVX2-only CPU
        engine = EngineSwigluExperts(ops, w13, w2)
        probe = w13.new_zeros(3, w13.shape[-1])
        torch.ops._C.onednn_mm(w13.new_empty(3, w13.shape[1]), probe, None, engine.handles13[0])
    except RuntimeError as e:
        return f"{w13.dtype}: the engine's oneDNN GEMM has no primitive on this CPU ({str(e).splitlines()[0]})"
    return engine


def _engine_grouped_mm(rows: torch.Tensor, handles: torch.Tensor, width: int, bounds: list[int]) -> torch.Tensor:
    out = rows.new_empty(rows.shape[0], width)
    start = 0
    for e, end in enumerate(bounds):
        if end > start:
            torch.ops._C.onednn_mm(out[start:end], rows[start:end], None, handles[e])
        start = end
    return out


def engine_swiglu_experts_forward(
    x: torch.Tensor,
    handles13: torch.Tensor,
    handles2: torch.Tensor,
    width13: int,
    hidden: int,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    limit: float | None,
) -> torch.Tensor:
    """``swiglu_experts`` on the engine's handles (``EngineSwigluExperts``; ``width13`` = 2I, ``hidden`` = H):
    the same routes, grouping and combine, each group's GEMMs through its expert's handle."""

    def experts(rows: torch.Tensor, routes: Routes) -> torch.Tensor:
        bounds = routes.offsets.tolist()  # CPU tensors: no device read
        h = swiglu(_engine_grouped_mm(rows.contiguous(), handles13, width13, bounds), limit)
        return _engine_grouped_mm(h.contiguous(), handles2, hidden, bounds)

    return grouped_experts(x, topk_weights, topk_ids, experts, num_experts=handles13.numel(), expert_map=expert_map)


# -- as vLLM custom ops ---------------------------------------------------------------------------
# The routed experts are registered opaque ops: vLLM's torch.compile sees one call of a known output
# shape (x's), and piecewise graph capture runs them eagerly between pieces (common.policy lists them
# as splitting ops). Their bodies read nothing on the host and dispatch a fixed op sequence
# (common/tests/test_experts_capture.py), so they could be captured with the rest of a step; the vLLM-CPU
# engine op (above) is the exception, on the CPU only. Model code calls the experts through them.
_swiglu_experts = dispatch.op("common.swiglu_experts")


def _swiglu_experts_op(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    limit: float | None,
) -> torch.Tensor:
    return _swiglu_experts(x, w13, w2, topk_weights, topk_ids, expert_map=expert_map, limit=limit)


def _experts_output_like(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return torch.empty_like(x)


# torch.ops.vllm.ascend_adapters_swiglu_experts: float experts (common.swiglu_experts) as one opaque call
compat.register_opaque_op("ascend_adapters_swiglu_experts", _swiglu_experts_op, fake_impl=_experts_output_like)
# torch.ops.vllm.ascend_adapters_engine_swiglu_experts: the same on vLLM-CPU's oneDNN handles
compat.register_opaque_op(
    "ascend_adapters_engine_swiglu_experts", engine_swiglu_experts_forward, fake_impl=_experts_output_like
)
