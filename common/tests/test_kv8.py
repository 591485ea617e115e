"""The 8-bit KV cache's rows (``common.kernels.kv8``), against the format its docstring documents.

The reference here is the E4M3 value table (every finite positive code, decoded from its bits by the OCP
spec's formula) and a nearest-value search over it: no cast of torch's is trusted to round.
"""

from __future__ import annotations

import pytest
import torch

from ascend_adapters.common.kernels import kv8

PARTS = (32, 16, 24)  # GLM-DSA's kv_c | k_pe | indexer key, at tiny widths


def e4m3_values() -> torch.Tensor:
    """The finite non-negative E4M3 values by the OCP spec: exponent bias 7, 3 mantissa bits, subnormals
    ``m * 2**-9``, ``0b1111_111`` (S.1111.111) NaN: 127 values, 0 to 448."""
    out = []
    for bits in range(127):
        e, m = bits >> 3, bits & 7
        out.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(out, dtype=torch.float64)


def nearest_e4m3(v: torch.Tensor) -> torch.Tensor:
    table = e4m3_values()
    dist = (v.double().abs()[..., None] - table).abs()
    best = dist.min(dim=-1, keepdim=True).values
    # ties to even: of two equally near values, the one whose code is even
    candidates = (dist == best) & (torch.arange(127) % 2 == 0)
    idx = torch.where(candidates.any(-1), candidates.int().argmax(-1), dist.argmin(-1))
    return table[idx] * torch.sign(v.double())


def _rows(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, sum(PARTS), generator=g)
    x[..., PARTS[0] : PARTS[0] + PARTS[1]] *= 40.0  # parts of unlike magnitude keep their own scales
    x[..., -PARTS[2] :] *= 1e-3
    return x


def test_stored_row_is_codes_then_one_float32_scale_per_part():
    x = _rows((5,))
    stored = kv8.kv8_quantize(x, PARTS)
    assert stored.dtype == torch.uint8
    assert stored.shape == (5, kv8.row_bytes(PARTS)) == (5, sum(PARTS) + 4 * len(PARTS))
    scales = stored[:, sum(PARTS) :].contiguous().view(torch.float32)
    amax = torch.stack([p.abs().amax(-1) for p in x.split(PARTS, -1)], -1)
    assert torch.equal(scales, amax / 448.0)
    codes = stored[:, : sum(PARTS)].view(torch.float8_e4m3fn).double()
    want = nearest_e4m3(x.double() / scales.double().repeat_interleave(torch.tensor(PARTS), dim=-1))
    # float32 division before the rounding may move a value that sits within 2**-24 of a midpoint: none here
    assert torch.equal(codes, want)


def test_read_back_within_half_an_e4m3_step():
    """|x - read| <= 2**-4 |x| + 2**-10 a / 448 per element (a: its part's largest magnitude): half the
    spacing of 3 mantissa bits for a normal code, half the subnormal step 2**-9 of the scale otherwise."""
    x = _rows((3, 7), seed=1)
    read = kv8.kv8_dequantize(kv8.kv8_quantize(x, PARTS), PARTS)
    assert read.shape == x.shape and read.dtype == torch.float32
    for part, got in zip(x.split(PARTS, -1), read.split(PARTS, -1)):
        a = part.abs().amax(-1, keepdim=True)
        bound = 2.0**-4 * part.abs() + 2.0**-10 * a / 448.0
        assert ((got - part).abs() <= bound * (1 + 1e-6)).all()
    # the largest element of each part is read back exactly (it maps onto 448)
    for part, got in zip(x.split(PARTS, -1), read.split(PARTS, -1)):
        i = part.abs().argmax(-1, keepdim=True)
        torch.testing.assert_close(got.gather(-1, i), part.gather(-1, i), rtol=1e-6, atol=0)


def test_a_part_of_zeros_reads_back_as_zeros():
    x = _rows((4,))
    x[:, -PARTS[2] :] = 0.0  # a shared DSA layer's indexer part
    stored = kv8.kv8_quantize(x, PARTS)
    assert torch.equal(stored[:, sum(PARTS) :].contiguous().view(torch.float32)[:, -1], torch.ones(4))
    assert torch.equal(kv8.kv8_dequantize(stored, PARTS)[:, -PARTS[2] :], torch.zeros(4, PARTS[2]))


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_cache_rows_declares_what_it_stores(model_dtype):
    plain = kv8.CacheRows(PARTS, model_dtype, "auto")
    assert (plain.dtype, plain.width) == (model_dtype, sum(PARTS))
    x = _rows((2,)).to(model_dtype)
    assert plain.encode(x) is x and plain.decode(x) is x
    for name in kv8.EIGHT_BIT_CACHE_DTYPES:
        rows = kv8.CacheRows(PARTS, model_dtype, name)
        assert (rows.dtype, rows.width) == (torch.uint8, kv8.row_bytes(PARTS))
        stored = rows.encode(x)
        assert stored.shape == (2, rows.width)
        # gathered rows (any leading shape, a strided slice of the paged cache) decode alike
        cache = torch.stack([stored, stored.flip(0)])  # [2 blocks, 2 rows, width]
        torch.testing.assert_close(rows.decode(cache)[0], rows.decode(stored), rtol=0, atol=0)


def test_the_gates_reference_quantises_as_the_adapters_do():
    """``testing.kv8_reference.e4m3_round_trip`` (the served gates' references, written from the spec) reads
    back what the adapters' ops store, row by row (one part a row, as the references quantise)."""
    from ascend_adapters.testing.kv8_reference import e4m3_round_trip

    x = torch.randn(2000, 64, generator=torch.Generator().manual_seed(3))
    x *= torch.rand(2000, 1, generator=torch.Generator().manual_seed(4)) * 5
    x[0] = 0.0
    read = kv8.kv8_dequantize(kv8.kv8_quantize(x, (64,)), (64,))
    assert torch.equal(read, e4m3_round_trip(x))


def test_bytes_never_written_read_back_finite():
    """Every byte pattern reads back finite: rows of a block another cache group wrote (NaN codes 0x7F/0xFF,
    a NaN or infinite scale) are masked by a zero weight downstream, which a NaN would survive."""
    parts = (4, 2)
    stored = torch.arange(256, dtype=torch.uint8).view(-1, 1).expand(256, kv8.row_bytes(parts)).contiguous()
    read = kv8.kv8_dequantize(stored, parts)
    assert torch.isfinite(read).all()
    assert not torch.isfinite(stored[:, :4].view(torch.float8_e4m3fn).float()).all()  # the codes held NaNs


# --- the int8 form (--kv-cache-dtype int8_per_token_head): torch_npu's npu_dynamic_quant per part ------------


def test_int8_row_is_npu_dynamic_quants_codes_and_scales():
    """Per part (torch_npu-npu_dynamic_quant.md 功能说明): ``scale = rowMax(abs(x)) / 127``, codes
    ``round(x / scale)`` in int8, from the part rounded to bfloat16 when it is float32 (its input dtypes)."""
    x = _rows((7,))
    stored = kv8.kv8_int8_quantize(x, PARTS)
    assert stored.dtype == torch.uint8 and stored.shape == (7, kv8.row_bytes(PARTS))
    scales = stored[:, sum(PARTS) :].contiguous().view(torch.float32)
    xb = x.to(torch.bfloat16).double()
    for i, p in enumerate(xb.split(PARTS, -1)):
        assert torch.equal(scales[:, i], (p.abs().amax(-1) / 127).float())
    codes = stored[:, : sum(PARTS)].view(torch.int8).double()
    want = torch.round(xb / scales.double().repeat_interleave(torch.tensor(PARTS), dim=-1))
    assert torch.equal(codes, want)
    assert codes.abs().amax(-1).eq(127).all()  # each part's largest value maps onto 127


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_read_back_within_half_a_step(dtype):
    """|x - read| <= a / 254 per element (a: its part's largest magnitude), plus, for a float32 part, its
    rounding to bfloat16 (2**-8 |x|, and 2**-8 of a in the scale), plus float32's own roundings of the scale,
    the quotient (which may land a value just short of a half-integer on it) and the product (2**-22 |x|)."""
    x = _rows((50,)).to(dtype)
    read = kv8.kv8_int8_dequantize(kv8.kv8_int8_quantize(x, PARTS), PARTS)
    assert read.dtype == torch.float32
    cols = torch.repeat_interleave(torch.arange(len(PARTS)), torch.tensor(PARTS))
    a = torch.stack([p.abs().amax(-1) for p in x.double().split(PARTS, -1)], -1)[:, cols]
    bf16 = dtype == torch.float32
    bound = a / 254 * (1 + (2**-8 if bf16 else 0)) + (2.0**-8 if bf16 else 2.0**-22) * x.double().abs()
    assert ((read.double() - x.double()).abs() <= bound).all()
    zeros = torch.zeros(3, sum(PARTS))
    assert torch.equal(kv8.kv8_int8_dequantize(kv8.kv8_int8_quantize(zeros, PARTS), PARTS), zeros)


def test_the_gates_int8_reference_quantises_as_the_adapters_do():
    """``testing.kv8_reference.int8_round_trip`` (written from npu_dynamic_quant's page) reads back what the
    adapters' int8 ops store, row by row."""
    from ascend_adapters.testing.kv8_reference import int8_round_trip

    x = torch.randn(2000, 64, generator=torch.Generator().manual_seed(5))
    x *= torch.rand(2000, 1, generator=torch.Generator().manual_seed(6)) * 5
    x[0] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        read = kv8.kv8_int8_dequantize(kv8.kv8_int8_quantize(x.to(dtype), (64,)), (64,))
        assert torch.equal(read.to(dtype), int8_round_trip(x.to(dtype)))


def test_int8_bytes_never_written_read_back_finite():
    parts = (4, 2)
    stored = torch.arange(256, dtype=torch.uint8).view(-1, 1).expand(256, kv8.row_bytes(parts)).contiguous()
    assert torch.isfinite(kv8.kv8_int8_dequantize(stored, parts)).all()


@pytest.mark.parametrize("cache_dtype", kv8.EIGHT_BIT_CACHE_DTYPES)
def test_a_write_and_a_read_are_graph_shaped(cache_dtype):
    """Quantising a step's rows and reading rows back read no device value on the host and dispatch the
    same ops at 2 and at 64 rows (``testing.capture.HostReads``): they sit inside captured decode steps. (One
    row is one op fewer: its scale bytes are contiguous already, so reading them copies nothing.)"""
    from ascend_adapters.testing.capture import HostReads

    rows = kv8.CacheRows(PARTS, torch.float32, cache_dtype)
    ops = []
    for n in (2, 64):
        x = _rows((n,))
        rows.decode(rows.encode(x))  # warm: the column-to-part index is made once per layout and device
        mode = HostReads()
        with mode:
            rows.decode(rows.encode(x))
        assert not mode.seen, mode.seen
        ops.append(dict(mode.ops))
    assert ops[0] == ops[1], ops
