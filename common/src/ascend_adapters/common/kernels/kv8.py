"""The 8-bit KV cache (``--kv-cache-dtype fp8`` / ``int8_per_token_head``): a cached row as 8-bit codes and a
float32 scale per part, stored as bytes.

A row of ``C`` values made of parts of widths ``w_1 .. w_n`` (GLM-DSA's ``kv_c | k_pe | indexer key``,
a DeepSeek-V4 cache's entry) is stored in ``C + 4 n`` bytes::

    [ codes of part 1 | ... | of part n | scale_1 ... scale_n (float32, native byte order) ]

Two code formats, one byte a value either way:

* ``fp8`` / ``fp8_e4m3``: float8 e4m3. ``scale_i = max|part_i| / 448`` (448: e4m3's largest finite value, so
  the largest element maps onto it; a part of zeros gets scale 1), each code ``part_i / scale_i`` rounded to
  the nearest e4m3 value (ties to even: torch's ``float8_e4m3fn`` cast). Error of a read, per element ``x`` of
  a part with largest magnitude ``a``: 3 mantissa bits, so a normal code (``|x| / scale >= 2**-6``) is within
  half a step, ``2**-4 |x|``, and a subnormal one within ``2**-10 scale = 2**-10 a / 448``.
* ``int8_per_token_head``: int8, torch_npu's ``npu_dynamic_quant`` (torch_npu-npu_dynamic_quant.md 功能说明:
  ``scale = rowMax(abs(x)) / 127``, ``y = round(x / scale)``; a part of zeros: scale 0, codes 0). That op takes
  float16/bfloat16 only (参数说明 x), so a float32 part is rounded to bfloat16 first, in both kernels. Error of a
  read: half a step, ``|x - read| <= a / 254``; a float32 part adds its rounding to bfloat16 (``2**-8 |x|``,
  and ``2**-8`` of ``a`` in the scale). ``x / scale`` is evaluated in float32 (the scale's dtype), where a
  bfloat16 value over it often lands on a half-integer exactly: ties go to even.

A row reads back as ``code * scale_i`` in float32. One scale per part, as vLLM's MLA fp8 layouts keep one
beside the row (``fp8_ds_mla``: one per 128 values of ``kv_c``): a part's magnitude (the rotated ``k_pe``, an
indexer key) need not be ``kv_c``'s.

``common.kv8_quantize`` / ``common.kv8_dequantize`` (e4m3) and ``common.kv8_int8_quantize`` /
``common.kv8_int8_dequantize`` are plain torch (a cast or a rounding, one amax per part).
``common.kv8_int8_quantize`` has an NPU twin, ``npu_dynamic_quant`` per part. torch_npu documents no float8
e4m3 quantisation for Atlas A2/A3 (910B/910C: ``npu_quantize`` writes qint8, quint8, int32 or quint4x2), so the
e4m3 ops have none and the start-up policy refuses ``fp8`` on an NPU (``policy.cache_dtype_refusal``), naming
``int8_per_token_head``.
"""

from __future__ import annotations

import functools

import torch

from ascend_adapters.common import dispatch
from ascend_adapters.common.policy import EIGHT_BIT_CACHE_DTYPES, INT8_CACHE_DTYPES
from ascend_adapters.common.policy import EIGHT_BIT_SCALE_BYTES as SCALE_BYTES
from ascend_adapters.common.policy import eight_bit_row_bytes as row_bytes

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


@functools.lru_cache(maxsize=64)
def _column_parts(parts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The part index of each of a row's ``sum(parts)`` columns (made once per layout and device)."""
    return torch.repeat_interleave(torch.arange(len(parts)), torch.tensor(parts)).to(device)


@dispatch.portable("common.kv8_quantize")
def kv8_quantize(rows: torch.Tensor, parts: tuple[int, ...]) -> torch.Tensor:
    """``rows [..., sum(parts)]`` (any float dtype) as stored bytes ``[..., row_bytes(parts)]`` (uint8)."""
    x = rows.float()
    amax = torch.stack([p.abs().amax(dim=-1) for p in x.split(parts, dim=-1)], dim=-1)  # [..., n]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    cols = _column_parts(tuple(parts), x.device)
    codes = (x / scale[..., cols]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([codes, scale.contiguous().view(torch.uint8)], dim=-1)


@dispatch.portable("common.kv8_dequantize")
def kv8_dequantize(stored: torch.Tensor, parts: tuple[int, ...]) -> torch.Tensor:
    """Stored bytes ``[..., row_bytes(parts)]`` read back as float32 rows ``[..., sum(parts)]``, every value
    finite: a row this cache never wrote (a block vLLM lent another cache group, whose pages share the
    block's bytes: DeepSeek-V4's packed layout) holds any bytes, NaN codes and scales included, and the
    attention kernels mask such rows by a zero weight, which a NaN would survive. A written row is finite."""
    return _read_back(stored, parts, torch.float8_e4m3fn)


def _read_back(stored: torch.Tensor, parts: tuple[int, ...], code_dtype: torch.dtype) -> torch.Tensor:
    """Both formats' read: the codes (``code_dtype``) times their part's scale, in float32, every value finite."""
    width = sum(parts)
    codes = stored[..., :width].view(code_dtype).float()
    scale = stored[..., width : width + SCALE_BYTES * len(parts)].contiguous().view(torch.float32)
    rows = codes * scale[..., _column_parts(tuple(parts), stored.device)]
    return torch.nan_to_num(rows, nan=0.0, posinf=0.0, neginf=0.0)


INT8_MAX = 127.0


def _int8_input(part: torch.Tensor) -> torch.Tensor:
    """A part as npu_dynamic_quant takes it: float16/bfloat16 as given, anything else rounded to bfloat16."""
    return part if part.dtype in (torch.float16, torch.bfloat16) else part.to(torch.bfloat16)


def _int8_stored(codes: list[torch.Tensor], scales: list[torch.Tensor]) -> torch.Tensor:
    """Each part's int8 codes ``[..., w_i]`` and float32 scale ``[...]`` as a stored row (both int8 kernels)."""
    return torch.cat([*(c.view(torch.uint8) for c in codes), torch.stack(scales, dim=-1).view(torch.uint8)], dim=-1)


@dispatch.portable("common.kv8_int8_quantize")
def kv8_int8_quantize(rows: torch.Tensor, parts: tuple[int, ...]) -> torch.Tensor:
    """``rows [..., sum(parts)]`` as stored int8 bytes ``[..., row_bytes(parts)]`` (uint8): per part
    npu_dynamic_quant's formula, rounding half to even."""
    codes, scales = [], []
    for p in rows.split(parts, dim=-1):
        x = _int8_input(p).float()
        scale = x.abs().amax(dim=-1) / INT8_MAX
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes.append(torch.round(x / safe[..., None]).clamp(-128, 127).to(torch.int8))
        scales.append(scale)
    return _int8_stored(codes, scales)


@dispatch.npu("common.kv8_int8_quantize")
def kv8_int8_quantize_npu(rows: torch.Tensor, parts: tuple[int, ...]) -> torch.Tensor:
    """``npu_dynamic_quant`` per part (x float16/bfloat16 of more than one dimension -> int8 y and a float32
    scale of x's shape less its last dimension: torch_npu-npu_dynamic_quant.md 参数说明, 返回值说明)."""
    import torch_npu

    lead = rows.shape[:-1]
    codes, scales = [], []
    for p in rows.split(parts, dim=-1):
        y, scale = torch_npu.npu_dynamic_quant(_int8_input(p).reshape(-1, p.shape[-1]))
        codes.append(y.reshape(*lead, -1))
        scales.append(scale.reshape(lead))
    return _int8_stored(codes, scales)


@dispatch.portable("common.kv8_int8_dequantize")
def kv8_int8_dequantize(stored: torch.Tensor, parts: tuple[int, ...]) -> torch.Tensor:
    """Stored int8 bytes read back as float32 rows, every value finite (``kv8_dequantize``'s reason)."""
    return _read_back(stored, parts, torch.int8)


class CacheRows:
    """How a layer stores its cache rows: in the model dtype, or 8-bit (an 8-bit ``--kv-cache-dtype``:
    e4m3 or int8 codes, ``EIGHT_BIT_CACHE_DTYPES``).

    ``dtype`` / ``width``: the storage dtype and the row's width in it (what the layer's KV-cache spec
    declares); ``encode`` turns the step's float rows into stored rows, ``decode`` stored rows (any
    leading shape) back into float rows (float32 from 8-bit, the model dtype otherwise)."""

    def __init__(self, parts: tuple[int, ...], model_dtype: torch.dtype, cache_dtype: str = "auto"):
        self.parts = tuple(int(p) for p in parts)
        self.eight_bit = cache_dtype in EIGHT_BIT_CACHE_DTYPES
        self.dtype = torch.uint8 if self.eight_bit else model_dtype
        self.width = row_bytes(self.parts) if self.eight_bit else sum(self.parts)
        int8 = cache_dtype in INT8_CACHE_DTYPES
        self._quantize = dispatch.op("common.kv8_int8_quantize" if int8 else "common.kv8_quantize")
        self._dequantize = dispatch.op("common.kv8_int8_dequantize" if int8 else "common.kv8_dequantize")

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return self._quantize(rows, self.parts) if self.eight_bit else rows

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        return self._dequantize(stored, self.parts) if self.eight_bit else stored
