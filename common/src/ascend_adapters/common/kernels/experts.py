"""Routed experts: the per-expert loop over routed tokens, shared by every MoE kernel here.

A route is one (token, slot) of the router's ``topk_ids [T, k]`` (global expert ids; negative: no
route). ``expert_map [E_global]`` maps a global id to this rank's local id (-1: another rank).
``grouped_experts`` sorts this rank's routes by expert (stable, so tokens keep their order inside
an expert), runs ``expert(e, rows)`` once per expert with tokens and adds each result, times its
router weight, into its token's row. ``grouped_experts_reference`` is the plain form: one route at a
time, in float64.

``common.swiglu_experts`` is the float MoE of this shape: ``w13 [E, 2I, H]`` (gate rows then up
rows), ``w2 [E, H, I]``, SwiGLU (optionally clamped) between them. Its NPU twin runs both matmuls as
one ``npu_grouped_matmul`` each (m-grouped, single tensors, cumulative ``group_list``).
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
    """This rank's routes sorted by local expert: ``tokens [R]``, ``weights [R]`` float32, ``counts [E]``."""

    tokens: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor


def sort_routes(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None
) -> Routes:
    t, k = topk_ids.shape[0], topk_ids.shape[-1]
    local = local_routes(topk_ids.reshape(t, k), num_local_experts, expert_map).reshape(-1)
    tok = torch.arange(t, device=topk_ids.device).repeat_interleave(k)
    wts = topk_weights.reshape(-1).float()
    keep = local >= 0
    local, tok, wts = local[keep], tok[keep], wts[keep]
    order = torch.argsort(local, stable=True)
    local, tok, wts = local[order], tok[order], wts[order]
    return Routes(tok, wts, torch.bincount(local, minlength=num_local_experts))


def grouped_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
    *,
    num_experts: int,
    expert_map: torch.Tensor | None = None,
    weight_on_input: bool = False,
    acc_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``sum over routes of w * expert(e, x[token])`` per token, ``[T, H]`` in x.dtype.

    One ``expert(e, rows)`` call per local expert with tokens. The sum is accumulated in
    ``acc_dtype`` (default x.dtype): each expert output and its router weight are cast to it before
    the product. ``weight_on_input`` scales the rows (in float32, rounded to x.dtype) instead.
    """
    acc = acc_dtype or x.dtype
    out = torch.zeros(x.shape[0], x.shape[-1], dtype=acc, device=x.device)
    if x.shape[0] == 0:
        return out.to(x.dtype)
    routes = sort_routes(topk_weights, topk_ids, num_experts, expert_map)
    start = 0
    for e, n in enumerate(routes.counts.tolist()):
        if n == 0:
            continue
        tok, w = routes.tokens[start : start + n], routes.weights[start : start + n]
        start += n
        rows = x[tok]
        if weight_on_input:
            rows = (rows.float() * w[:, None]).to(x.dtype)
            out.index_add_(0, tok, expert(e, rows).to(acc))
        else:
            out.index_add_(0, tok, expert(e, rows).to(acc) * w[:, None].to(acc))
    return out.to(x.dtype)


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
    """Float routed experts: this rank's ``w13 [E, 2I, H]`` / ``w2 [E, H, I]``; this rank's partial sum."""

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(swiglu(F.linear(rows, w13[e]), limit), w2[e])

    return grouped_experts(x, topk_weights, topk_ids, expert, num_experts=w13.shape[0], expert_map=expert_map)


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

    out = torch.zeros_like(x)
    routes = sort_routes(topk_weights, topk_ids, w13.shape[0], expert_map)
    if routes.tokens.numel() == 0:
        return out
    # group_list_type 0 (cumulative counts) is valid for any number of experts; type 1 "may not have
    # length 1" (npu_grouped_matmul.md 参数说明 group_list).
    group_list = torch.cumsum(routes.counts, 0).to(torch.int64)

    def gmm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # 表2 非量化 rows: x and weight of one float dtype, y in it; 单单单 场景: weight [E, K, N] (a
        # transposed view is allowed: "支持weight转置"), split_item 2, group_type 0.
        return torch_npu.npu_grouped_matmul(
            [a], [w.transpose(1, 2)], group_list=group_list, split_item=2, group_type=0, group_list_type=0
        )[0]

    h = swiglu_npu(gmm(x[routes.tokens], w13), limit)
    o = gmm(h, w2)
    out.index_add_(0, routes.tokens, o * routes.weights[:, None].to(x.dtype))
    return out


# -- as vLLM custom ops ---------------------------------------------------------------------------
# The routed experts sort and count their routes on the host (one call per expert with tokens), which
# no compiled graph can hold. Through these ops vLLM's torch.compile sees one opaque call of a known
# output shape (x's), and piecewise graph capture runs them eagerly between pieces (common.policy
# lists them as splitting ops). Model code calls the experts through them.
def _swiglu_experts_op(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    limit: float | None,
) -> torch.Tensor:
    return dispatch.op("common.swiglu_experts")(x, w13, w2, topk_weights, topk_ids, expert_map=expert_map, limit=limit)


def _experts_output_like(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return torch.empty_like(x)


# torch.ops.vllm.ascend_adapters_swiglu_experts: float experts (common.swiglu_experts) as one opaque call
compat.register_opaque_op("ascend_adapters_swiglu_experts", _swiglu_experts_op, fake_impl=_experts_output_like)
