"""A portable attention "backend" for DeepSeek-V4's paged caches.

Every attention layer keeps its state in up to four caches (``memory.layer_caches``), each an
attention-like layer (``attention.DeepseekV4Cache``) with a KV-cache spec of its own: vLLM groups
them, allocates their blocks as the request grows, frees the blocks a sliding window has left and
hands each cache the metadata of its group per step. This backend's metadata is that bookkeeping,
prepared outside the compiled graph from vLLM's host copies: the step's query boundaries (on the
device), each token's request, the group's block table, and how the step's queries are laid out as
grids (``Segment``): all decodes in one, each prefill request in tiles. The
attention itself (``vllm::dsv4_attention``) reads and writes the caches with plain torch indexing,
so the same path runs on CPU and on an NPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

from ascend_adapters.common import compat
from ascend_adapters.common.attention_backend import LayerAttentionBackend, token_requests

# queries of one prefill request attended at a time (``attention.DeepseekV4Attention``): its score
# matrices stay QUERY_TILE x (window + tile + entries) whatever the chunk's length
QUERY_TILE = 256


@dataclass
class Segment:
    """Queries attended in one pass, as a grid of ``requests`` rows x ``queries`` columns: requests
    ``first_request ..`` of the step, each its queries ``offset .. offset + queries`` (fewer where a
    request has fewer: those cells are padding). ``token_rows``: the step's token rows the grid
    covers, ``[start, stop)``."""

    first_request: int
    requests: int
    offset: int
    queries: int
    token_rows: tuple[int, int]


@dataclass
class DeepseekV4CacheMetadata(AttentionMetadata):
    block_table: torch.Tensor  # [num_reqs, max_blocks] long: this cache group's blocks of each request
    query_start_loc: torch.Tensor  # [num_reqs + 1] on the device
    token_request: torch.Tensor  # [num_tokens] long on the device: the request of each token
    num_tokens: int
    max_seq_len: int  # an upper bound of every request's length after this step
    # the decodes (vLLM puts them first) in one grid; each prefill request's queries in tiles
    segments: list[Segment] = field(default_factory=list)


def step_segments(query_start_loc_cpu: torch.Tensor, decode_threshold: int) -> list[Segment]:
    """How a step's queries are attended, from the host copy of its query boundaries: the leading
    requests of at most ``decode_threshold`` queries (vLLM's reordered decodes and MTP verifications) in
    one grid, each later request in tiles of QUERY_TILE queries."""
    starts = query_start_loc_cpu.tolist()
    n = len(starts) - 1
    lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    decodes = 0
    while decodes < n and lens[decodes] <= decode_threshold:
        decodes += 1
    segments = []
    if decodes:
        segments.append(Segment(0, decodes, 0, max(lens[:decodes]), (0, starts[decodes])))
    for r in range(decodes, n):
        for a in range(0, lens[r], QUERY_TILE):
            b = min(lens[r], a + QUERY_TILE)
            segments.append(Segment(r, 1, a, b - a, (starts[r] + a, starts[r] + b)))
    return segments


def step_metadata(
    query_start_loc: torch.Tensor, block_table: torch.Tensor, max_seq_len: int, segments: list[Segment]
) -> DeepseekV4CacheMetadata:
    """A step's metadata: device tensors from vLLM's, the host values (``segments``, ``max_seq_len``)
    from its host copies; nothing read back from the device."""
    n = query_start_loc.shape[0] - 1
    tokens = segments[-1].token_rows[1] if segments else 0
    token_request = token_requests(query_start_loc, tokens)
    return DeepseekV4CacheMetadata(
        block_table=block_table[:n].to(torch.long),
        query_start_loc=query_start_loc,
        token_request=token_request,
        num_tokens=tokens,
        max_seq_len=max_seq_len,
        segments=segments,
    )


class DeepseekV4CacheMetadataBuilder(AttentionMetadataBuilder[DeepseekV4CacheMetadata]):
    # Decodes and MTP verifications are one grid per step: their ops, shapes and host values depend on
    # the number of requests and the query length only, so a uniform step (every request 1 token, or
    # 1 + the drafts) replays from a captured graph (tests/test_deepseek_v4_graph.py proves it).
    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # vLLM then puts the decodes (and MTP verifications) first in the batch
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> DeepseekV4CacheMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        segments = step_segments(m.query_start_loc_cpu[: n + 1], self.reorder_batch_threshold)
        return step_metadata(m.query_start_loc[: n + 1], m.block_table_tensor[:n], m.max_seq_len, segments)


class DeepseekV4CacheBackend(LayerAttentionBackend):
    @staticmethod
    def get_builder_cls():
        return DeepseekV4CacheMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls):
        # The caches' pages differ in size (memory.layer_caches: blocks of 128 positions or fewer, so that a
        # prefix hit lands every 128 tokens); vLLM packs them into one block id only in these layouts.
        return compat.block_outermost_kv_cache_layouts()
