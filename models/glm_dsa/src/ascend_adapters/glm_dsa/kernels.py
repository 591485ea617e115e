"""The model's own math, as kernel ops behind ``ascend_adapters.common.dispatch``.

Every op has a portable torch implementation (what the CPU tests run). The
rotary embedding is common's ``common.rope_interleaved`` (``ascend_adapters.common.kernels.rope``),
with its NPU twin there.

Attention is computed in the latent space, as vLLM's own MLA backends do:
the cache holds one row ``[kv_c | k_pe | indexer_k]`` per token, the query's
nope part is taken through ``W_UK`` (the key half of ``kv_b_proj``) into the
``kv_lora_rank``-wide latent space, scores are ``q_lat . kv_c + q_pe . k_pe``,
the output is the probability-weighted sum of ``kv_c`` rows, and ``W_UV``
(the value half) is applied to that sum. The re-expanding form (every cached
row through ``kv_b_proj``, then ordinary multi-head attention) is the
benchmark's peer and lives there (``bench/bench_glm_dsa.py``).

Layouts: ``N`` groups of ``S`` queries that share one set of ``K`` candidate
rows (a prefill chunk: N=1, S=its tokens, K=its request's context; the
step's decode tokens: N=tokens, S=1, K=the context width of the step; the
sparse attention of every token of a step: N=tokens, S=1, K=the rows each one
selected), H heads, R = kv_lora_rank, P = rope dim. Every shape comes from
the step's token and request counts and host integers of its metadata, never
from a device value, so a decode step replays as a captured graph.

* ``common.rope_interleaved`` (common's): interleaved ("GPT-J") rotary embedding
  of the rope slice, ``x [T, H, R]`` with ``cos``/``sin`` ``[T, R/2]``. The pairs stay
  in place; transformers' reference writes them de-interleaved, which gives the
  same dot products because queries and keys are permuted alike.
* ``glm_dsa.cache_write`` / ``glm_dsa.cache_gather`` / ``glm_dsa.cache_rows``:
  the paged cache ``[blocks, block_size, C]``; write rows at slots, read one
  request's first ``length`` rows (a prefill chunk's context), or read rows at
  any ``[..]`` slot tensor (the decodes' contexts and the sparse attention's
  gather of the selected rows; NPU twin ``npu_gather_sparse_index``).
* ``glm_dsa.indexer_topk``: lightning-indexer scores and the top-k context
  positions per query among its valid (causal) keys, ``-1`` where a query has
  fewer than ``topk`` valid keys.
* ``glm_dsa.latent_attention``: absorbed MLA over candidate rows and a mask.
"""

from __future__ import annotations

import torch

from ascend_adapters.common import dispatch
from ascend_adapters.common import kernels as _shared  # noqa: F401  (registers the shared ops the model calls)


@dispatch.portable("glm_dsa.cache_write")
def cache_write_portable(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """Write ``rows [T, C]`` at ``slot_mapping [T]`` of ``cache [B, N, C]``. A padding slot (< 0) goes to
    slot 0, which is in vLLM's null block (the block pool's block 0, never given to a request), so no
    host read decides which rows to write (capture-safe)."""
    flat = cache.view(-1, cache.shape[-1])
    n = slot_mapping.shape[0]
    flat.index_copy_(0, slot_mapping.to(torch.long).clamp(min=0), rows[:n].to(flat.dtype))


@dispatch.portable("glm_dsa.cache_gather")
def cache_gather_portable(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` rows of one request, ``[length, C]``."""
    block_size = cache.shape[1]
    nblocks = (length + block_size - 1) // block_size
    blocks = cache.index_select(0, block_row[:nblocks].to(torch.long))
    return blocks.reshape(-1, cache.shape[-1])[:length]


@dispatch.portable("glm_dsa.cache_rows")
def cache_rows_portable(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows at ``slots [...]`` (any shape, all valid slot ids) of ``cache [B, N, C]``: ``[..., C]``."""
    flat = cache.view(-1, cache.shape[-1])
    return flat.index_select(0, slots.reshape(-1).to(torch.long)).view(*slots.shape, cache.shape[-1])


@dispatch.npu("glm_dsa.cache_rows")
def cache_rows_npu(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``npu_gather_sparse_index``: y[i, :] = x[idx[i], :] (npu_gather_sparse_index.md 功能说明)."""
    import torch_npu

    flat = cache.view(-1, cache.shape[-1])
    return torch_npu.npu_gather_sparse_index(flat, slots.to(torch.long))


@dispatch.portable("glm_dsa.indexer_topk")
def indexer_topk_portable(
    q: torch.Tensor,  # [N, S, Hi, D] rope applied
    weights: torch.Tensor,  # [N, S, Hi] already scaled by Hi**-0.5
    k: torch.Tensor,  # [N, L, D]
    valid: torch.Tensor,  # [N, S, L] bool (causal and inside the request)
    topk: int,
) -> torch.Tensor:
    """Lightning indexer: relu(q.k) weighted over heads, the top-k positions per query among its valid
    keys as ``[N, S, min(topk, L)]`` (``-1`` where a query has fewer valid keys). ``q`` carries the
    indexer's softmax scale already."""
    length = k.shape[1]
    scores = torch.relu(torch.einsum("nshd,nld->nshl", q.float(), k.float()))
    index_scores = torch.einsum("nsh,nshl->nsl", weights.float(), scores)
    index_scores = index_scores.masked_fill(~valid, float("-inf"))
    values, top = index_scores.topk(min(topk, length), dim=-1)
    return top.masked_fill(values == float("-inf"), -1)


@dispatch.portable("glm_dsa.latent_attention")
def latent_attention_portable(
    q_lat: torch.Tensor,  # [N, S, H, R]: q_nope taken through W_UK
    q_pe: torch.Tensor,  # [N, S, H, P]: rope part of the query
    rows: torch.Tensor,  # [N, K, >= R + P]: cached [kv_c | k_pe | ...] rows
    mask: torch.Tensor,  # [N, S, K] bool, True = attend
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA: softmax(q_lat . kv_c + q_pe . k_pe) over the masked rows, times kv_c: ``[N, S, H, R]``."""
    r, p = q_lat.shape[-1], q_pe.shape[-1]
    kv_c = rows[..., :r].float()
    k_pe = rows[..., r : r + p].float()
    scores = torch.einsum("nshr,nkr->nshk", q_lat.float(), kv_c)
    scores = scores + torch.einsum("nshp,nkp->nshk", q_pe.float(), k_pe)
    scores = (scores * scale).masked_fill(~mask.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("nshk,nkr->nshr", probs, kv_c).to(q_lat.dtype)


def absorb_kv_b(w_kv_b: torch.Tensor, num_heads: int, nope: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``kv_b_proj``'s weight ``[H * (nope + v), R]`` into ``W_UK^T [H, R, nope]`` (query side) and
    ``W_UV [H, v, R]`` (output side), laid out so both products are row-major matrix-vector products."""
    w = w_kv_b.view(num_heads, nope + v_dim, w_kv_b.shape[-1])
    return w[:, :nope].transpose(1, 2).contiguous(), w[:, nope:].contiguous()


def absorb_query(q_nope: torch.Tensor, w_uk_t: torch.Tensor) -> torch.Tensor:
    """``q_nope [T, H, nope]`` through ``W_UK``: ``[T, H, R]``."""
    return torch.bmm(w_uk_t.to(q_nope.dtype), q_nope.permute(1, 2, 0)).permute(2, 0, 1).contiguous()


def expand_output(out_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """The latent attention output ``[T, H, R]`` through ``W_UV``: ``[T, H, v]``."""
    # contiguous: the result feeds o_proj, whose CPU GEMM wants unit stride on the last dimension
    return torch.bmm(w_uv.to(out_lat.dtype), out_lat.permute(1, 2, 0)).permute(2, 0, 1).contiguous()
