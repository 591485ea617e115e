"""A portable attention "backend" for the DSA latent cache.

vLLM allocates one paged cache per layer from the layer's KV cache spec and
hands every layer a metadata object per step. This backend's metadata is vLLM's
own device tensors of the step (query boundaries, sequence lengths, block
table, slots) and a few integers the builder takes from the host copies vLLM
hands it (how many requests lead the batch as decodes, an upper bound on the
contexts, the token range of each prefill chunk): the builder reads no device
value. The attention itself is computed by the model layer's
``vllm::glm_dsa_attention`` op with the portable kernels in ``kernels.py``; it
derives each token's request and context on the device from those tensors
(``common.attention_backend.token_requests``, ``decode_context``), so a decode step is one batched pass
whose ops and shapes depend on the step's token and request counts and its
context width only. Nothing here needs a device kernel, so the same path runs on
CPU and on an NPU.
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
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from ascend_adapters.common.attention_backend import LayerAttentionBackend, token_requests


@dataclass
class GlmDsaMetadata(AttentionMetadata):
    num_reqs: int
    num_actual_tokens: int
    # the first requests of the step (vLLM's reorder puts them first): at most the builder's decode threshold
    # of query tokens each (one, or the 1 + k of a speculative step), attended in one batched call
    num_decodes: int
    num_decode_tokens: int  # their tokens, the first of the step
    # the tokens attended: the decodes' and every prefill chunk's (not vLLM's padding after the last chunk)
    num_attended_tokens: int
    # an upper bound of every context of the step (host): the width the batched call reads each token's
    # context at, and the most rows a token can select
    context_width: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] (device)
    seq_lens: torch.Tensor  # [num_reqs] (device)
    block_table: torch.Tensor  # [num_reqs, max_blocks] (device)
    slot_mapping: torch.Tensor  # [num_actual_tokens] (device)
    # every later request (prefill chunks), one call each: (request, first token, end token, an upper
    # bound of its context)
    prefills: list[tuple[int, int, int, int]]


def context_slots(
    block_table: torch.Tensor, lengths: torch.Tensor, width: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slot of each of the first ``width`` positions of every row's context, ``[N, width]``, and whether
    the position is inside the context (``< lengths``); slot 0 (the null block) outside. ``block_table``: each
    row's block table ``[N, max_blocks]``, at least ``width`` positions wide."""
    pos = torch.arange(width, device=block_table.device)
    valid = pos[None, :] < lengths[:, None]
    blocks = block_table.to(torch.long).gather(1, (pos // block_size)[None, :].expand(lengths.shape[0], -1))
    slots = (blocks * block_size + pos % block_size).masked_fill(~valid, 0)
    return slots, valid


def selected_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of context ``positions [N, K]`` (``-1``: none, slot 0) of each row's block table ``[N, max_blocks]``."""
    pos = positions.clamp(min=0)
    blocks = block_table.to(torch.long).gather(1, pos // block_size)
    return (blocks * block_size + pos % block_size).masked_fill(positions < 0, 0)


def decode_context(md: GlmDsaMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots ``[D, context_width]`` and validity of the causal context of every decode token: token ``j``
    of a request's ``q`` sees its sequence less the ``q - 1 - j`` tokens after it. Computed on the device."""
    d = md.num_decode_tokens
    req = token_requests(md.query_start_loc[: md.num_decodes + 1], d)
    tokens = torch.arange(d, dtype=md.query_start_loc.dtype, device=md.query_start_loc.device)
    lengths = md.seq_lens[req] - md.query_start_loc[req + 1] + tokens + 1
    # at least one row: a padding token (past its request's end, or of a padding request) reads the null
    # block rather than nothing, so its discarded output stays finite
    return context_slots(md.block_table[req], lengths.clamp(min=1), md.context_width, block_size)


class GlmDsaMetadataBuilder(AttentionMetadataBuilder[GlmDsaMetadata]):
    # A decode step, and a speculative step of 1 + k query tokens per request (MTP verification, the
    # drafter's first pass), is one batched pass: its ops and shapes depend on its token and request counts
    # and the context width only, and a captured step holds the widest context (build_for_cudagraph_capture),
    # so a uniform batch replays exactly (test_glm_dsa_graph captures both and replays them on new caches
    # and lengths). A step with prefill chunks attends each chunk in a call of its own: no full capture.
    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        # vLLM puts requests of at most this many query tokens first: one, or 1 + k when it verifies k
        # speculative tokens (and the MTP drafter's first pass reads as many); they form the batched call
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> GlmDsaMetadata:
        return step_metadata(common_attn_metadata, self.reorder_batch_threshold, self.block_size)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> GlmDsaMetadata:
        """A captured step is replayed for later steps of the same shape, whatever their contexts: its
        batched call reads the widest context the block table addresses."""
        m = common_attn_metadata
        widest = m.block_table_tensor.shape[1] * self.block_size
        return step_metadata(m, self.reorder_batch_threshold, self.block_size, context_width=widest)


def step_metadata(
    m: CommonAttentionMetadata, decode_threshold: int, block_size: int, context_width: int | None = None
) -> GlmDsaMetadata:
    """A step's metadata from vLLM's common metadata, reading its host copies only: the leading requests of
    at most ``decode_threshold`` query tokens join the batched call (vLLM's ``split_decodes_and_prefills``),
    every later one is a prefill chunk. ``context_width``: the batched call's width, vLLM's upper bound on the
    step's contexts (``max_seq_len``) unless given."""
    n = m.num_reqs
    num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(m, decode_threshold=decode_threshold)
    widest = m.block_table_tensor.shape[1] * block_size
    width = min(context_width or m.max_seq_len, widest)
    qsl = m.query_start_loc_cpu[: n + 1].tolist()
    # a prefill chunk reads its request's context at vLLM's host bound of it where the engine hands one
    # (seq_lens_cpu_upper_bound: exact for prefill rows), else at the step's width
    bound = m.seq_lens_cpu_upper_bound
    bounds = bound[:n].tolist() if bound is not None else [width] * n
    prefills = [(r, qsl[r], qsl[r + 1], min(bounds[r], width)) for r in range(num_decodes, n) if qsl[r + 1] > qsl[r]]
    return GlmDsaMetadata(
        num_reqs=n,
        num_actual_tokens=m.num_actual_tokens,
        num_decodes=num_decodes,
        num_decode_tokens=num_decode_tokens,
        num_attended_tokens=prefills[-1][2] if prefills else num_decode_tokens,
        context_width=width,
        query_start_loc=m.query_start_loc[: n + 1],
        seq_lens=m.seq_lens[:n],
        block_table=m.block_table_tensor[:n],
        slot_mapping=m.slot_mapping[: m.num_actual_tokens],
        prefills=prefills,
    )


class GlmDsaPortableBackend(LayerAttentionBackend):
    @staticmethod
    def get_builder_cls():
        return GlmDsaMetadataBuilder
