"""DeepSeek-V4's own release format (``quantization_config.quant_method: fp8``), dequantized at load.

As published (docs/references.md#deepseek-v4-fp8-fp4), a weight ``X.weight`` that carries ``X.scale`` is one of:

* FP8 block-scaled (attention and shared-expert linears): ``X.weight`` F8_E4M3 ``[out, in]``,
  ``X.scale`` F8_E8M0 ``[ceil(out/B0), ceil(in/B1)]`` with ``[B0, B1] = weight_block_size``
  (``[128, 128]``): ``W[i, j] = float(e4m3 W[i, j]) * 2**s[i // B0, j // B1]``;
* FP4 e2m1 (routed experts): ``X.weight`` int8 ``[out, in/2]``, two values per byte along the input
  dimension, the low nibble first; ``X.scale`` F8_E8M0 ``[out, in/32]``:
  ``W[i, j] = e2m1(nibble j of row i) * 2**s[i, j // 32]``; an e2m1 nibble is sign (bit 3),
  exponent (bits 2-1), mantissa (bit 0): the values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.

F8_E8M0 is a biased power of two: ``2**(byte - 127)``, which torch's ``float8_e8m0fnu`` gives as a
float. Everything else (BF16 compressor / indexer projections, F32 norms, ``hc_*``, sinks) passes
through unchanged; the serving dtype cast happens in the parameter's loader.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float8_e8m0fnu
FP4_GROUP = 32
# e2m1 code (sign bit 3) -> value
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str) -> torch.Tensor:
    out, inp = weight.shape
    b0, b1 = block
    want = (-(-out // b0), -(-inp // b1))
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}.scale: shape {tuple(scale.shape)}, expected {want} for a [{out}, {inp}] FP8 weight")
    s = scale.float().repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :inp]
    return weight.float() * s


def dequant_fp4(weight: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    out, half = weight.shape
    inp = 2 * half
    if inp % FP4_GROUP or tuple(scale.shape) != (out, inp // FP4_GROUP):
        raise ValueError(
            f"{name}.scale: shape {tuple(scale.shape)}, expected ({out}, {inp // FP4_GROUP}) for FP4 experts "
            f"packed as [{out}, {half}] int8"
        )
    b = weight.view(torch.uint8).long()
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(out, inp)  # low nibble first
    return E2M1[codes] * scale.float().repeat_interleave(FP4_GROUP, 1)


def dequantize_release(
    weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pair every ``X.weight`` with its ``X.scale`` (any order across files) and yield float ``X.weight``."""
    pending_w: dict[str, torch.Tensor] = {}
    pending_s: dict[str, torch.Tensor] = {}

    def resolve(base: str):
        w, s = pending_w.pop(base), pending_s.pop(base)
        if s.dtype != SCALE_DTYPE:
            raise ValueError(f"{base}.scale: dtype {s.dtype}, expected F8_E8M0 ({SCALE_DTYPE})")
        if w.dtype == FP8_DTYPE:
            return dequant_fp8_block(w, s, block, base)
        if w.dtype in (torch.int8, torch.uint8):
            return dequant_fp4(w, s, base)
        raise ValueError(f"{base}.weight: dtype {w.dtype} with a .scale: neither F8_E4M3 nor packed FP4 (int8)")

    for name, tensor in weights:
        if name.endswith(".scale") and tensor.dtype == SCALE_DTYPE:
            base = name[: -len(".scale")]
            pending_s[base] = tensor
        elif name.endswith(".weight") and tensor.dtype in (FP8_DTYPE, torch.int8, torch.uint8):
            base = name[: -len(".weight")]
            pending_w[base] = tensor
        else:
            yield name, tensor
            continue
        if base in pending_w and base in pending_s:
            yield f"{base}.weight", resolve(base)
    if pending_w:
        first = sorted(pending_w)[0]
        raise ValueError(f"{first}.weight: {pending_w[first].dtype} without its {first}.scale ({len(pending_w)} such)")
    if pending_s:
        first = sorted(pending_s)[0]
        raise ValueError(f"{first}.scale: no {first}.weight in the checkpoint ({len(pending_s)} such)")
