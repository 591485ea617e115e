"""The shared shell of the adapters' portable attention backends (each adapter's ``backend.py``), and
``register_layer``, how a layer that keeps paged state makes itself known to vLLM.

An adapter whose layers attend over their own paged caches computes attention itself, in an opaque
op of the layer; vLLM still asks each cache layer for a backend, whose metadata builder turns the
step's bookkeeping into what that op reads. ``LayerAttentionBackend`` is everything but the builder:
an adapter subclasses it and names its builder in ``get_builder_cls``.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionImpl

from ascend_adapters.common import compat


def token_requests(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The request of each of a step's first ``num_tokens`` tokens, from its device query boundaries
    ``[num_reqs + 1]`` (no host read); a token past the last request's tokens counts as the last request's."""
    tokens = torch.arange(num_tokens, dtype=query_start_loc.dtype, device=query_start_loc.device)
    return torch.searchsorted(query_start_loc[1:], tokens, right=True).clamp(max=query_start_loc.shape[0] - 2)


def register_layer(name: str, layer) -> None:
    """Enter ``layer`` in vLLM's ``static_forward_context`` under ``name`` (its prefix), as vLLM's own
    attention and state layers do: vLLM then binds its caches and hands it its step's metadata."""
    from vllm.config import get_current_vllm_config

    context = get_current_vllm_config().compilation_config.static_forward_context
    if name in context:
        raise ValueError(f"Duplicate layer name: {name}")
    context[name] = layer


class LayerAttentionImpl(AttentionImpl):
    """Placeholder: the model's attention layer computes attention itself."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def forward(self, *args, **kwargs):  # pragma: no cover - never called
        raise NotImplementedError(f"{type(self).__name__} is not called; the model's attention layer computes it")


class LayerAttentionBackend(AttentionBackend):
    supported_dtypes = [torch.float32, torch.float16, torch.bfloat16]
    forward_includes_kv_cache_update = True

    @staticmethod
    def get_name() -> str:
        # vLLM's enum has no entry for out-of-tree backends; the name is only logged.
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return LayerAttentionImpl

    get_kv_cache_shape = staticmethod(compat.latent_kv_cache_shape)  # asked by vLLM 0.27/0.28 only

    @classmethod
    def is_mla(cls) -> bool:
        return True
