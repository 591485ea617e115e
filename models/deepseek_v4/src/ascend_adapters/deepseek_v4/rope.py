"""DeepSeek-V4's two rotary sets (``main`` for sliding layers, ``compress`` for compressed layers, the
compressed entries and the indexer's queries), taken from vLLM's rotary embeddings."""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.rotary_embedding import get_rope

from ascend_adapters.deepseek_v4.config import vllm_rope_parameters


def deepseek_v4_rope(config, label: str, max_model_len: int) -> nn.Module:
    """vLLM's DeepSeek-V4 rotary embedding for one rope set (``main`` or ``compress``), shared by
    every layer that uses it (``get_rope`` caches it); see ``config.vllm_rope_parameters``."""
    rope = get_rope(
        config.head_dim,
        max_position=config.max_position_embeddings,
        rope_parameters=vllm_rope_parameters(config, label),
        is_neox_style=False,
    )
    if rope.cos_sin_cache.shape[0] < max_model_len:
        raise ValueError(
            f"DeepSeek-V4 rope set {label!r} covers {rope.cos_sin_cache.shape[0]} positions "
            f"(original_max_position_embeddings x factor), fewer than max_model_len={max_model_len}"
        )
    return rope


def apply_rope(rope: nn.Module, positions: torch.Tensor, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing rope channels of ``x`` (``[T, heads, D]``, or ``[T, D]`` for one head)."""
    out, _ = rope(positions, x if x.dim() == 3 else x.unsqueeze(1), None, inverse=inverse)
    return out.view_as(x)
