"""Interleaved ("GPT-J") RoPE on the trailing channels of a tensor.

``x [T, ..., D]``; ``cos`` / ``sin`` ``[T, rd/2]`` (one angle per pair); the last ``rd`` channels of
``x`` hold the pairs ``(x0, x1), (x2, x3), ...``, each rotated in place:

    (a, b) -> (a cos - b sin, b cos + a sin)

the leading ``D - rd`` channels pass through. GLM-DSA rotates its whole rope slice (rd = D),
DeepSeek-V4 the trailing rope part of each head (and undoes it with ``-sin``). The portable op
computes in float32 and rounds once to x's dtype; ``rope_interleaved_reference`` is the same rotation
as a complex product in float64.

NPU twin: ``npu_rotary_mul(rotary_mode="interleave")`` on ``[T, N, 1, rd]`` with ``cos``/``sin``
repeated per pair as ``[T, 1, 1, rd]`` (the S11D layout of npu_rotary_mul.md 约束说明), the heads in
blocks under its B*N < 1000 limit. That page admits r1/r2 in [-1, 1] only: tables scaled past 1
(YaRN's attention factor) are divided by their largest magnitude and the result multiplied back.
"""

from __future__ import annotations

import torch

from ascend_adapters.common import dispatch

# npu_rotary_mul.md 约束说明 (interleave): "B*N < 1000" for the layouts r1/r2 may take
_NPU_ROPE_MAX_HEADS = 999


def rope_interleaved_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``(a + ib) * (cos + i sin)`` per pair, in float64; returns float64."""
    rd = 2 * cos.shape[-1]
    lead = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
    pairs = x[..., -rd:].double().reshape(*x.shape[:-1], rd // 2, 2)
    z = torch.complex(pairs[..., 0], pairs[..., 1])
    rot = torch.complex(cos.double().reshape(lead), sin.double().reshape(lead))
    out = torch.view_as_real(z * rot).reshape(*x.shape[:-1], rd)
    return torch.cat([x[..., :-rd].double(), out], dim=-1)


@dispatch.portable("common.rope_interleaved")
def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``2 * cos.shape[-1]`` channels of ``x [T, ..., D]``."""
    rd = 2 * cos.shape[-1]
    view = (cos.shape[0],) + (1,) * (x.dim() - 2) + (rd,)
    c = cos.float().repeat_interleave(2, dim=-1).view(view)
    s = sin.float().repeat_interleave(2, dim=-1).view(view)
    rope = x[..., -rd:].float()
    rot = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    out = (rope * c + rot * s).to(x.dtype)
    if rd == x.shape[-1]:
        return out
    return torch.cat([x[..., :-rd], out], dim=-1)


@dispatch.npu("common.rope_interleaved")
def rope_interleaved_npu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    import torch_npu

    t, rd = x.shape[0], 2 * cos.shape[-1]
    heads = x[..., -rd:].reshape(t, -1, 1, rd)  # [T, N, 1, rd]
    # npu_rotary_mul.md 约束说明: r1/r2 in [-1, 1]; a table scaled past 1 is divided by its largest
    # magnitude m (no host sync: m stays a tensor) and the product multiplied by m again.
    m = torch.maximum(cos.abs().amax(), sin.abs().amax()).clamp(min=1.0)
    c = (cos / m).repeat_interleave(2, dim=-1).view(t, 1, 1, rd).to(x.dtype)
    s = (sin / m).repeat_interleave(2, dim=-1).view(t, 1, 1, rd).to(x.dtype)
    blocks = [
        torch_npu.npu_rotary_mul(heads[:, a : a + _NPU_ROPE_MAX_HEADS].contiguous(), c, s, rotary_mode="interleave")
        for a in range(0, heads.shape[1], _NPU_ROPE_MAX_HEADS)
    ]
    out = (torch.cat(blocks, dim=1) * m.to(x.dtype)).view(*x.shape[:-1], rd)
    if rd == x.shape[-1]:
        return out
    return torch.cat([x[..., :-rd], out], dim=-1)
