"""The re-expanding form of multi-head latent attention: GLM-DSA's kernel tests' reference and its
benchmark's peer (the model serves the absorbed, latent-space form of ``glm_dsa.kernels``)."""

from __future__ import annotations

import torch


def mla_reference(
    q: torch.Tensor,  # [T, H, nope + P]: the full query (nope | rope)
    rows: torch.Tensor,  # [L, >= R + P]: one request's cached rows
    w_kv_b: torch.Tensor,  # [H * (nope + v), R]
    mask: torch.Tensor,  # [T, L] bool
    scale: float,
    nope: int,
    v_dim: int,
) -> torch.Tensor:
    """The re-expanding form: every cached row through ``kv_b_proj`` into per-head keys and values, then
    masked multi-head attention, ``[T, H, v]``. Same model as the absorbed path; its cost grows with the
    context times ``kv_b_proj``'s width at every step (the benchmark's peer)."""
    h = q.shape[1]
    r = w_kv_b.shape[-1]
    p = q.shape[-1] - nope
    kv = (rows[:, :r].float() @ w_kv_b.float().t()).view(-1, h, nope + v_dim)
    k_pe = rows[:, r : r + p].float()
    k = torch.cat([kv[..., :nope], k_pe[:, None, :].expand(-1, h, -1)], dim=-1)
    scores = torch.einsum("thd,lhd->htl", q.float(), k) * scale
    scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("htl,lhd->thd", probs, kv[..., nope:]).to(q.dtype)
