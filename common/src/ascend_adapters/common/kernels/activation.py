"""SwiGLU on a fused ``[gate | up]`` tensor, optionally clamped.

    gate, up = h[..., :I], h[..., I:]
    clamped (limit > 0): gate = min(gate, limit), up = clamp(up, -limit, limit)   (DeepSeek-V4, gpt-oss)
    swiglu(h) = silu(gate) * up

The portable op computes in the input's dtype (callers that want float32 pass float32).
NPU twin: ``npu_swiglu`` (no limit) or ``npu_clipped_swiglu`` with alpha 1, bias 0 and halves split
front/back (its formula, npu_clipped_swiglu.md 功能说明 step 4: A = A.clamp(max=limit),
B = B.clamp(-limit, limit), y = A * sigmoid(alpha * A) * (B + bias)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ascend_adapters.common import dispatch


def clamps(limit: float | None) -> bool:
    return limit is not None and limit > 0


def swiglu_reference(h: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """The formula written out, in float64: ``g / (1 + exp(-g)) * u`` after the clamps."""
    gate, up = h.double().chunk(2, dim=-1)
    if clamps(limit):
        gate = torch.where(gate > limit, limit, gate)
        up = torch.where(up > limit, limit, torch.where(up < -limit, -limit, up))
    return gate / (1 + torch.exp(-gate)) * up


@dispatch.portable("common.swiglu")
def swiglu(h: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """``h [..., 2I]`` -> ``[..., I]`` in h's dtype."""
    gate, up = h.chunk(2, dim=-1)
    if clamps(limit):
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


@dispatch.npu("common.swiglu")
def swiglu_npu(h: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    import torch_npu

    if not clamps(limit):
        return torch_npu.npu_swiglu(h, dim=-1)
    # npu_clipped_swiglu.md 参数说明 x: "不支持非连续的Tensor"; interleaved=False: front/back halves
    return torch_npu.npu_clipped_swiglu(
        h.contiguous(), dim=-1, alpha=1.0, limit=float(limit), bias=0.0, interleaved=False
    )
