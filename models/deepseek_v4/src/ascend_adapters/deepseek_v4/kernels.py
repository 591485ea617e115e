"""DeepSeek-V4 math as portable torch ops behind common's dispatch layer.

Each op is registered with ``@dispatch.portable``. Everything runs in float32 where the reference
does (norms, mHC weights, router scores, softmaxes). The ops DeepSeek-V4 shares with the other
adapters live in ``ascend_adapters.common.kernels``: the clamped SwiGLU (``common.swiglu``) and the
routed float experts (``common.swiglu_experts``), each with its NPU twin; RoPE is vLLM's
``DeepseekV4ScalingRotaryEmbedding`` (``model.py``).

NPU twins of this model's own hot ops (op-plugin docs/zh/custom_APIs/torch_npu, searched for each):

* ``dsv4.compress_windows`` (a CSA compressor's softmax-gated pooling of two windows) and
  ``dsv4.window_summaries`` (an HCA compressor's running pooling of its window): no documented op;
* ``dsv4.sink_attention`` (the sparse attention over the window and the compressed entries the
  indexer keeps, with a per-head sink logit): ``npu_fused_infer_attention_score_v2`` documents a
  ``learnable_sink`` input; a twin through it is not written yet (its contract is not emulated);
* ``dsv4.route`` hash routing (``tid2eid[token]`` then sqrtsoftplus scores gathered):
  ``npu_moe_gating_top_k`` scores by sigmoid/softmax with a top-k only, no table and no
  sqrtsoftplus: no documented op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ascend_adapters.common import dispatch
from ascend_adapters.common import kernels as _shared  # noqa: F401  (registers the shared ops the model calls)


# ---------------------------------------------------------------- norms
@dispatch.portable("dsv4.rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; ``weight=None`` is the unweighted variant."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return h.to(dtype)
    return weight * h.to(dtype)


# ---------------------------------------------------------------- mHC
@dispatch.portable("dsv4.hc_pre")
def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
):
    """mHC weights for one block: ``streams [T, N, D]`` -> (post [T,N], comb [T,N,N], collapsed [T,D])."""
    t, n, _ = streams.shape
    flat = rms_norm(streams.reshape(t, -1).float(), None, norm_eps)
    mixes = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb = torch.softmax(comb_w.view(t, n, n) * s_comb + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


@dispatch.portable("dsv4.hc_post")
def hc_post(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """new[k] = post[k] * out + sum_j comb[j, k] * streams[j]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


@dispatch.portable("dsv4.hc_head")
def hc_head(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc_eps: float, norm_eps: float
) -> torch.Tensor:
    flat = rms_norm(streams.flatten(1).float(), None, norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


# ---------------------------------------------------------------- MoE
def score_fn(logits: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if kind == "sigmoid":
        return torch.sigmoid(logits)
    if kind == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"unknown scoring_func {kind!r}")


@dispatch.portable("dsv4.route")
def route(
    logits: torch.Tensor,
    *,
    top_k: int,
    scoring: str,
    scaling: float,
    normalize: bool,
    bias: torch.Tensor | None = None,
    hash_ids: torch.Tensor | None = None,
):
    """Top-k (score + bias) or hash (``hash_ids`` from tid2eid) routing -> (weights, ids)."""
    scores = score_fn(logits.float(), scoring)
    if hash_ids is not None:
        ids = hash_ids.long()
    else:
        sel = scores + bias.float() if bias is not None else scores
        ids = torch.topk(sel, top_k, dim=-1, sorted=False).indices
    w = scores.gather(1, ids)
    if normalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scaling, ids


# ---------------------------------------------------------------- attention
@dispatch.portable("dsv4.sink_attention")
def sink_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    allowed: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    own_kv: torch.Tensor | None = None,
    own_allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shared-KV MQA with a per-head sink logit in the softmax denominator, for ``B`` rows of ``L``
    queries each (a row: one request's queries of the step).

    q ``[B, L, H, D]``; kv ``[B, S, D]`` is both key and value, shared by a row's queries;
    allowed ``[B, L, S]`` bool. ``own_kv [B, L, K, D]`` / ``own_allowed [B, L, K]``: keys of each query
    alone (the compressed entries its indexer selected), in the same softmax.
    """
    b, n = q.shape[:2]
    qf = q.float()
    logits = torch.einsum("blhd,bsd->blhs", qf, kv.float()) * scale
    parts = [logits.masked_fill(~allowed[:, :, None, :], float("-inf"))]
    if own_kv is not None:
        own = torch.einsum("blhd,blkd->blhk", qf, own_kv.float()) * scale
        parts.append(own.masked_fill(~own_allowed[:, :, None, :], float("-inf")))
    parts.append(sinks.float().view(1, 1, -1, 1).expand(b, n, -1, 1))
    comb = torch.cat(parts, dim=-1)
    comb = comb - comb.max(dim=-1, keepdim=True).values
    probs = torch.softmax(comb, dim=-1)
    s = kv.shape[1]
    out = torch.einsum("blhs,bsd->blhd", probs[..., :s], kv.float())
    if own_kv is not None:
        out = out + torch.einsum("blhk,blkd->blhd", probs[..., s:-1], own_kv.float())
    return out.to(q.dtype)


@dispatch.portable("dsv4.compress_windows")
def compress_windows(kv: torch.Tensor, gate: torch.Tensor, head_dim: int, has_prev: torch.Tensor) -> torch.Tensor:
    """Softmax-gated pooling of a CSA entry's two overlapping windows: ``kv``/``gate`` ``[N, 2*ratio,
    2*head_dim]`` (the gate with ``position_bias`` added) -> ``[N, head_dim]`` before the norm. Rows
    ``[0, ratio)`` are the previous window, of which the first half of the channels (Ca) counts, rows
    ``[ratio, 2*ratio)`` the entry's own window, of which the second half (Cb) counts; ``has_prev [N]``
    bool is False for entry 0 (no previous window: its rows weigh nothing and their values are not read).
    """
    r, d = kv.shape[1] // 2, head_dim
    none = ~has_prev[:, None, None]
    prev_kv = kv[:, :r, :d].masked_fill(none, 0)
    prev_gate = gate[:, :r, :d].masked_fill(none, float("-inf"))
    all_kv = torch.cat([prev_kv, kv[:, r:, d:]], dim=1)
    all_gate = torch.cat([prev_gate, gate[:, r:, d:]], dim=1)
    return (all_kv * all_gate.softmax(dim=1, dtype=torch.float32).to(all_kv.dtype)).sum(dim=1)


@dispatch.portable("dsv4.window_summaries")
def window_summaries(
    kv: torch.Tensor,
    gate: torch.Tensor,
    window: torch.Tensor,
    valid: torch.Tensor,
    carried: torch.Tensor,
    prev: torch.Tensor,
) -> torch.Tensor:
    """Each cell's summary of its window so far, for a grid of ``R`` rows of ``L`` consecutive positions
    (``kv``/``gate`` ``[R, L, C]``, the gate with ``position_bias`` added; ``window [R, L]``: each cell's
    window number; ``valid [R, L]``: cells that hold a token). A summary is ``[o | lse]`` (``[R, L, 2C]``,
    float32): ``o`` the softmax-gated pooling of the window's positions up to the cell (what
    ``compress_windows`` pools once the window is whole) and ``lse`` the log of the softmax's denominator,
    per channel. ``prev [R, 2C]``: the summary at the position before each row's first cell, folded into the
    row's first window where ``carried [R]`` (that window began before the row).

    Each window's largest gate in the grid (and ``prev``'s lse) is the exponent's offset: a cell whose own
    gates lie far below a later cell's may underflow, but only a window's last cell in the grid is ever
    read (by the next step, or as the entry), and its offset is the largest of what it sums."""
    r, n, c = kv.shape
    kv, gate = kv.float(), gate.float()
    ninf = torch.tensor(float("-inf"), device=kv.device)
    local = (window - window[:, :1]).clamp(min=0)  # the row's windows counted from its first
    gate = torch.where(valid[..., None], gate, ninf)
    offset = torch.full((r, n, c), float("-inf"), device=kv.device)
    offset = offset.scatter_reduce(1, local[..., None].expand(-1, -1, c), gate, reduce="amax")
    prev_o, prev_lse = prev.float().split(c, dim=-1)
    # a row not carried reads a position never written (before its request, or another's): its bytes are not read
    prev_o = torch.where(carried[:, None], prev_o, torch.zeros_like(prev_o))
    prev_lse = torch.where(carried[:, None], prev_lse, ninf)
    offset[:, 0] = torch.maximum(offset[:, 0], prev_lse)
    offset = torch.where(torch.isfinite(offset), offset, torch.zeros_like(offset)).gather(
        1, local[..., None].expand(-1, -1, c)
    )
    weight = torch.exp(gate - offset)  # [R, L, C]; 0 at invalid cells
    # cell j sums the valid cells j' <= j of its window
    j = torch.arange(n, device=kv.device)
    same = (local[:, :, None] == local[:, None, :]) & (j[None, :, None] >= j[None, None, :]) & valid[:, None, :]
    same = same.float()
    total = torch.bmm(same, weight)
    pooled = torch.bmm(same, weight * kv)
    carry = torch.exp(prev_lse[:, None, :] - offset) * (local == 0)[..., None]  # 0 where not carried
    total = total + carry
    pooled = pooled + carry * prev_o[:, None, :]
    total = total.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.cat([pooled / total, offset + torch.log(total)], dim=-1)


@dispatch.portable("dsv4.indexer_scores")
def indexer_scores(
    q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, softmax_scale: float, weights_scale: float
) -> torch.Tensor:
    """Lightning indexer: ``sum_h w[b,l,h] * relu(q[b,l,h] . k[b,s])`` -> ``[B, L, S]``.

    q ``[B, L, Hi, Di]``, keys ``[B, S, Di]`` (a row's compressed keys), weights ``[B, L, Hi]``
    (weights_proj output).
    """
    s = torch.einsum("blhd,bsd->blhs", q.float(), keys.float())
    s = F.relu(s) * softmax_scale
    return (s * (weights.float() * weights_scale).unsqueeze(-1)).sum(dim=2)


@dispatch.portable("dsv4.grouped_linear")
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """Block-diagonal projection: x ``[T, G, in]``, weight ``[G*out, in]`` -> ``[T, G*out]``."""
    t, g, d = x.shape
    w = weight.view(groups, -1, d)
    return torch.einsum("tgi,goi->tgo", x, w).reshape(t, -1)
