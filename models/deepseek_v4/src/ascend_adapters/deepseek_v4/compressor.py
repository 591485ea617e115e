"""DeepSeek-V4's compressor: gated pooling of ``rate`` consecutive layer inputs into one KV entry
(CSA: overlapping pairs of windows; HCA: one window), normalised and rotated at the window start."""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear

from ascend_adapters.common import dispatch
from ascend_adapters.deepseek_v4.rope import apply_rope

op = dispatch.op


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

    def pool(self, x: torch.Tensor, first_pos: int, rope: nn.Module, has_prev: bool) -> torch.Tensor:
        """Entries for the whole windows in ``x`` (rows from ``first_pos``, a window start).

        With overlap and ``has_prev`` the first window of ``x`` only feeds the next entry.
        """
        kv = self.kv_proj(x)
        gate = self.gate_proj(x) + self.position_bias.repeat(x.shape[0] // self.rate, 1)
        pooled, _ = op("dsv4.compress_windows")(kv, gate, self.rate, self.overlap, self.head_dim, has_prev)
        out = self.kv_norm(pooled)
        first_w = first_pos // self.rate + (1 if (self.overlap and has_prev) else 0)
        pos = torch.arange(out.shape[0], device=x.device) * self.rate + first_w * self.rate
        return apply_rope(rope, pos, out)
