"""DeepSeek-V4's compressor: gated pooling of ``rate`` consecutive layer inputs into one KV entry
(CSA: overlapping pairs of windows; HCA: one window), normalised and rotated at the window start.

Each token's KV projection and gate (its state) are computed once, in the step that brings the token.
A CSA compressor caches them (``memory.STATE``, its last two windows: eight rows at rate 4) and the token
that closes a window pools the cached states. An HCA window is 128 rows, so its compressor caches instead,
per position, a running summary of the window so far (``kernels.window_summaries``: the pooling up to that
position and the log of its softmax denominator, float32): a step reads the summary before its first token,
and the token that closes a window holds the window's pooling in its own summary."""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear

from ascend_adapters.common import dispatch
from ascend_adapters.deepseek_v4.rope import apply_rope

# the kernel ops, looked up once
_compress_windows = dispatch.op("dsv4.compress_windows")
_window_summaries = dispatch.op("dsv4.window_summaries")


class DeepseekV4Compressor(nn.Module):
    """Gated pooling of ``rate`` tokens into one KV entry (CSA: overlapping pairs of windows)."""

    def __init__(self, config, rate: int, head_dim: int, overlap: bool, quant_config, prefix: str):
        super().__init__()
        self.rate, self.head_dim, self.overlap = rate, head_dim, overlap
        width = (2 if overlap else 1) * head_dim
        self.kv_proj = ReplicatedLinear(
            config.hidden_size,
            width,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.kv_proj",
            return_bias=False,
        )
        self.gate_proj = ReplicatedLinear(
            config.hidden_size,
            width,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_proj",
            return_bias=False,
        )
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = RMSNorm(head_dim, config.rms_norm_eps)

    def states(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each token's state ``[T, 2 * width]``: its KV projection, then its gate with the position
        bias of its place in its window."""
        gate = self.gate_proj(x) + self.position_bias[positions % self.rate]
        return torch.cat([self.kv_proj(x), gate], dim=-1)

    def pool(self, states: torch.Tensor, has_prev: torch.Tensor, window: torch.Tensor, rope) -> torch.Tensor:
        """CSA: the entries of ``N`` windows from their states ``[N, 2 * rate, 2 * width]`` (the previous
        window's rows, then the entry's own), each rotated at its window's first position (``window [N]``:
        window numbers)."""
        kv, gate = states.chunk(2, dim=-1)
        pooled = _compress_windows(kv, gate, self.head_dim, has_prev)
        return self.finish(pooled, window, rope)

    def summaries(
        self, states: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, carried: torch.Tensor, prev
    ) -> torch.Tensor:
        """HCA: the running summary ``[R, L, 2 * head_dim]`` (float32) of each cell of a grid of consecutive
        positions (``states [R, L, 2 * head_dim]``, ``positions``/``valid [R, L]``), continuing ``prev [R, 2 *
        head_dim]`` (the summary before each row's first cell) where ``carried [R]``."""
        kv, gate = states.chunk(2, dim=-1)
        return _window_summaries(kv, gate, positions // self.rate, valid, carried, prev)

    def finish(self, pooled: torch.Tensor, window: torch.Tensor, rope) -> torch.Tensor:
        """Pooled windows ``[N, head_dim]`` (model dtype) normalised and rotated at each window's first position."""
        return apply_rope(rope, window * self.rate, self.kv_norm(pooled))
