"""A portable attention "backend" for DeepSeek-V4's paged caches.

Every attention layer keeps its state in up to four caches (``memory.layer_caches``), each an
attention-like layer (``attention.DeepseekV4Cache``) with a KV-cache spec of its own: vLLM groups
them, allocates their blocks as the request grows, frees the blocks a sliding window has left and
hands each cache the metadata of its group per step. This backend's metadata is that bookkeeping,
prepared outside the compiled graph: the step's query boundaries and the group's block table. The
attention itself (``vllm::dsv4_attention``) reads and writes the caches with plain torch indexing,
so the same path runs on CPU and on an NPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

from ascend_adapters.common.attention_backend import LayerAttentionBackend


@dataclass
class DeepseekV4CacheMetadata(AttentionMetadata):
    query_start_loc: list[int]  # host, num_reqs + 1
    first_positions: list[int]  # host: each request's position of its first query token this step
    block_table: torch.Tensor  # [num_reqs, max_blocks] long: this cache group's blocks of each request


class DeepseekV4CacheMetadataBuilder(AttentionMetadataBuilder[DeepseekV4CacheMetadata]):
    reorder_batch_threshold = None
    # The attention walks the requests on the host (the query boundaries are a list): a captured decode
    # step would replay the boundaries of the step it was captured in. vLLM runs vllm::dsv4_attention
    # eagerly between the compiled pieces and captures no full graph of this model.
    _cudagraph_support = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> DeepseekV4CacheMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        qsl = m.query_start_loc_cpu[: n + 1]
        # vLLM 0.32 keeps no host copy of the sequence lengths: one read per step here, outside the
        # graph, instead of one per request in every layer's attention
        first = m.seq_lens[:n].cpu() - (qsl[1:] - qsl[:-1])
        return DeepseekV4CacheMetadata(
            query_start_loc=qsl.tolist(),
            first_positions=first.tolist(),
            block_table=m.block_table_tensor[:n].to(torch.long),
        )


class DeepseekV4CacheBackend(LayerAttentionBackend):
    @staticmethod
    def get_builder_cls():
        return DeepseekV4CacheMetadataBuilder
