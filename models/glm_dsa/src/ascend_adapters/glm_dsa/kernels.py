"""The model's own math, as kernel ops behind ``ascend_adapters.common.dispatch``.

Every op has a portable torch implementation (what the CPU tests run). The
rotary op also has a thin NPU form; the NPU forms are not tested here.

Layouts: T tokens of one step, L context tokens of one request, H heads.

* ``glm_dsa.rope``: interleaved ("GPT-J") rotary embedding of the rope slice,
  ``x [T, H, R]`` with ``cos``/``sin`` ``[T, R/2]``. The pairs stay in place;
  transformers' reference writes them de-interleaved, which gives the same
  dot products because queries and keys are permuted alike.
* ``glm_dsa.cache_write`` / ``glm_dsa.cache_gather``: one latent row per token
  (``[kv_c | k_pe | indexer_k]``) in a paged cache ``[blocks, block_size, C]``.
* ``glm_dsa.indexer_select``: lightning-indexer scores and top-k selection,
  returning a boolean ``[T, L]`` mask (causal and selected).
* ``glm_dsa.masked_attention``: softmax attention restricted to a mask.
"""

from __future__ import annotations

import torch

from ascend_adapters.common import dispatch


@dispatch.portable("glm_dsa.rope")
def rope_portable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... of ``x [T, H, R]``."""
    cos = cos.unsqueeze(1).to(torch.float32)
    sin = sin.unsqueeze(1).to(torch.float32)
    xf = x.to(torch.float32)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return out.to(x.dtype)


@dispatch.npu("glm_dsa.rope")
def rope_npu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # pragma: no cover
    """torch_npu interleaved rotary (mode 1). Not exercised on CPU."""
    import torch_npu

    t, h, r = x.shape
    c = torch.repeat_interleave(cos, 2, dim=-1).view(t, 1, 1, r).to(x.dtype)
    s = torch.repeat_interleave(sin, 2, dim=-1).view(t, 1, 1, r).to(x.dtype)
    return torch_npu.npu_rotary_mul(x.view(t, h, 1, r), c, s, rotary_mode="interleave").view(t, h, r)


@dispatch.portable("glm_dsa.cache_write")
def cache_write_portable(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """Write ``rows [T, C]`` at ``slot_mapping [T]`` of ``cache [B, N, C]`` (slots < 0 skipped)."""
    flat = cache.view(-1, cache.shape[-1])
    n = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.long)
    valid = slots >= 0
    if bool(valid.all()):
        flat.index_copy_(0, slots, rows[:n].to(flat.dtype))
    else:
        flat.index_copy_(0, slots[valid], rows[:n][valid].to(flat.dtype))


@dispatch.portable("glm_dsa.cache_gather")
def cache_gather_portable(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` rows of one request, ``[length, C]``."""
    block_size = cache.shape[1]
    nblocks = (length + block_size - 1) // block_size
    blocks = cache.index_select(0, block_row[:nblocks].to(torch.long))
    return blocks.reshape(-1, cache.shape[-1])[:length]


@dispatch.portable("glm_dsa.indexer_select")
def indexer_select_portable(
    q: torch.Tensor,  # [T, Hi, D] rope applied
    weights: torch.Tensor,  # [T, Hi] already scaled by Hi**-0.5
    k: torch.Tensor,  # [L, D]
    causal: torch.Tensor,  # [T, L] bool
    topk: int,
    softmax_scale: float,
) -> torch.Tensor:
    """Lightning indexer: relu(q.k) weighted over heads, top-k per query among causal keys."""
    length = k.shape[0]
    if length <= topk:
        return causal
    scores = torch.einsum("thd,ld->thl", q.float(), k.float()) * softmax_scale
    scores = torch.relu(scores)
    index_scores = torch.einsum("th,thl->tl", weights.float(), scores)
    index_scores = index_scores.masked_fill(~causal, float("-inf"))
    top = index_scores.topk(topk, dim=-1).indices
    selected = torch.zeros_like(causal).scatter_(-1, top, True)
    return selected & causal


@dispatch.portable("glm_dsa.masked_attention")
def masked_attention_portable(
    q: torch.Tensor,  # [T, H, Dk]
    k: torch.Tensor,  # [L, H, Dk]
    v: torch.Tensor,  # [L, H, Dv]
    mask: torch.Tensor,  # [T, L] bool, True = attend
    scale: float,
) -> torch.Tensor:
    scores = torch.einsum("thd,lhd->htl", q.float(), k.float()) * scale
    scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("htl,lhd->thd", probs, v.float())
    return out.to(q.dtype)
