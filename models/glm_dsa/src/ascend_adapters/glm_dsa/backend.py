"""A portable attention "backend" for the DSA latent cache.

vLLM allocates one paged cache per layer from the layer's KV cache spec and
hands every layer a metadata object per step. This backend's metadata is the
plain per-request bookkeeping (query boundaries, context lengths, block table,
slots), prepared here outside the compiled graph; the attention itself is
computed by the model layer's ``vllm::glm_dsa_attention`` op with the portable
kernels in ``kernels.py``. Nothing here needs a device kernel, so
the same path runs on CPU and on an NPU.
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
class GlmDsaMetadata(AttentionMetadata):
    num_reqs: int
    num_actual_tokens: int
    query_start_loc: list[int]  # host, num_reqs + 1
    seq_lens: list[int]  # host, num_reqs
    block_table: torch.Tensor  # [num_reqs, max_blocks] (device)
    slot_mapping: torch.Tensor  # [num_actual_tokens] (device)
    # decode tokens, batched: every query token of a request with at most ``decode_query_max`` of them (one,
    # or 1 + the speculative tokens being verified or drafted), each with its own causal context
    decode_tokens: torch.Tensor  # [D] long
    decode_slots: torch.Tensor  # [D, Lmax] long (slot 0 beyond a token's context; see decode_valid)
    decode_valid: torch.Tensor  # [D, Lmax] bool
    # requests with more query tokens (prefill chunks): (request, first token, end token, context length)
    prefills: list[tuple[int, int, int, int]]


def context_slots(
    block_table: torch.Tensor, lengths: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slot of every position ``< length`` of each request, ``[N, max(length)]``, and its validity."""
    lmax = int(lengths.max()) if lengths.numel() else 0
    pos = torch.arange(lmax, device=block_table.device)
    valid = pos[None, :] < lengths[:, None]
    blocks = block_table.to(torch.long).gather(1, (pos // block_size)[None, :].expand(len(lengths), -1))
    slots = (blocks * block_size + pos % block_size).masked_fill(~valid, 0)
    return slots, valid


class GlmDsaMetadataBuilder(AttentionMetadataBuilder[GlmDsaMetadata]):
    reorder_batch_threshold = None
    # No full-graph capture of the attention: a decode step's tensors are as wide as its longest context
    # (decode_slots), a shape a captured graph would freeze. vLLM runs vllm::glm_dsa_attention eagerly
    # between the compiled (piecewise-captured) pieces instead; test_glm_dsa_compiled proves both read
    # no device value on the host.
    _cudagraph_support = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        # a speculative step verifies (and the MTP drafter's first pass reads) 1 + k tokens per request: they
        # join the batched decode call instead of a per-request prefill call each
        spec = vllm_config.speculative_config
        self.decode_query_max = 1 + (spec.num_speculative_tokens if spec is not None else 0)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> GlmDsaMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        qsl = m.query_start_loc_cpu[: n + 1].tolist()
        seq_lens = m.seq_lens[:n].cpu().tolist()
        block_table = m.block_table_tensor[:n]
        return step_metadata(
            qsl, seq_lens, block_table, m.slot_mapping[: m.num_actual_tokens], self.block_size, self.decode_query_max
        )


def step_metadata(
    qsl: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    decode_query_max: int,
) -> GlmDsaMetadata:
    """A step's metadata from its host bookkeeping: a request with at most ``decode_query_max`` query
    tokens joins the batched decode call (each token with its causal context), any other is a prefill."""
    n = len(seq_lens)
    rows, tokens, lengths, prefills = [], [], [], []
    for r in range(n):
        q = qsl[r + 1] - qsl[r]
        if q > decode_query_max:
            prefills.append((r, qsl[r], qsl[r + 1], seq_lens[r]))
            continue
        for j in range(q):  # token j of the request sees its context up to and including itself
            rows.append(r)
            tokens.append(qsl[r] + j)
            lengths.append(seq_lens[r] - q + 1 + j)
    device = block_table.device
    slots, valid = context_slots(
        block_table[torch.tensor(rows, dtype=torch.long, device=device)],
        torch.tensor(lengths, dtype=torch.long, device=device),
        block_size,
    )
    return GlmDsaMetadata(
        num_reqs=n,
        num_actual_tokens=qsl[n],
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=slot_mapping,
        decode_tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        decode_slots=slots,
        decode_valid=valid,
        prefills=prefills,
    )


class GlmDsaPortableBackend(LayerAttentionBackend):
    @staticmethod
    def get_builder_cls():
        return GlmDsaMetadataBuilder
