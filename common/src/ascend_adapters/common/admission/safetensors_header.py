"""Read and validate a safetensors header without torch.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of UTF-8 JSON +
the data buffer. The JSON maps tensor names to ``{"dtype", "shape",
"data_offsets": [begin, end]}`` (offsets relative to the data buffer) plus an
optional ``__metadata__`` map of strings. This reader only reads the header and
checks that it describes the data buffer exactly: allowed dtypes, offsets equal
to shape x dtype size, tensors contiguous from 0 with no overlap or gap, and no
trailing bytes after the last tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct

from ascend_adapters.common.admission.report import Report

# Bytes per element. Sub-byte and exotic types are deliberately absent: an
# unknown dtype is refused.
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})

# Same bound as the safetensors library: a header above this is refused.
MAX_HEADER_BYTES = 100_000_000
_TENSOR_KEYS = {"dtype", "shape", "data_offsets"}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclasses.dataclass
class Header:
    path: str
    header_len: int
    file_size: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None

    @property
    def data_bytes(self) -> int:
        return self.file_size - 8 - self.header_len


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(path: str | os.PathLike, report: Report, where: str | None = None) -> Header | None:
    """Parse and validate ``path``'s header; every problem goes to ``report``.

    Returns the header when it is valid, ``None`` otherwise. Reads at most
    ``8 + MAX_HEADER_BYTES`` bytes and never writes.
    """
    where = where or str(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                report.error("st-truncated", where, f"file is {size} bytes, shorter than the 8-byte header length")
                return None
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                report.error("st-header-size", where, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
                return None
            if 8 + n > size:
                report.error("st-truncated", where, f"header length {n} runs past the end of the {size}-byte file")
                return None
            raw = f.read(n)
    except OSError as exc:
        report.error("st-unreadable", where, f"cannot read: {exc}")
        return None
    if len(raw) != n:
        report.error("st-truncated", where, f"read {len(raw)} of {n} header bytes")
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        report.error("st-header-json", where, f"header is not UTF-8 ({exc})")
        return None
    if not text.startswith("{"):
        report.error("st-header-json", where, "header does not start with '{'")
        return None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:
        report.error("st-header-json", where, f"header is not valid JSON ({exc})")
        return None
    if not isinstance(obj, dict):
        report.error("st-header-json", where, "header JSON is not an object")
        return None
    return _validate(obj, where, n, size, report)


def _validate(obj: dict, where: str, n: int, size: int, report: Report) -> Header | None:
    bad = len(report.errors)
    metadata = obj.pop("__metadata__", None)
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        report.error("st-metadata", where, "__metadata__ must map strings to strings")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in obj.items():
        tw = f"{where}:{name}"
        if not isinstance(entry, dict) or set(entry) != _TENSOR_KEYS:
            keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            report.error("st-entry", tw, f"entry must have exactly dtype/shape/data_offsets, has {keys}")
            continue
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            report.error("st-dtype", tw, f"dtype {dtype!r} is not in the allow-list {sorted(DTYPE_SIZES)}")
            continue
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            report.error("st-shape", tw, f"shape {shape!r} is not a list of non-negative integers")
            continue
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]
        ):
            report.error("st-offsets", tw, f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
            continue
        expected = math.prod(shape) * DTYPE_SIZES[dtype]
        if offsets[1] - offsets[0] != expected:
            report.error(
                "st-offsets",
                tw,
                f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, shape {shape} x {dtype} needs {expected}",
            )
            continue
        tensors[name] = TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])
    data_len = size - 8 - n
    pos = 0
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin < pos:
            report.error("st-overlap", f"{where}:{t.name}", f"data [{t.begin}, {t.end}) overlaps the previous tensor")
        elif t.begin > pos:
            report.error("st-gap", f"{where}:{t.name}", f"{t.begin - pos} unused bytes before this tensor's data")
        pos = max(pos, t.end)
    if pos > data_len:
        report.error(
            "st-truncated", where, f"tensors need {pos} data bytes, the file holds {data_len} (truncated file?)"
        )
    elif pos < data_len:
        report.error("st-trailing", where, f"{data_len - pos} trailing bytes after the last tensor")
    if len(report.errors) > bad:
        return None
    return Header(where, n, size, tensors, metadata)


class HeaderError(ValueError):
    """A safetensors file whose header cannot be used; the message names the file and every problem."""


def read_tensors(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Every tensor of ``path`` from its validated header: the one reader for quant, adapters and admission.

    Same checks and the same size cap as ``read_header``; raises ``HeaderError`` instead of reporting.
    """
    report = Report()
    header = read_header(path, report)
    if header is None:
        raise HeaderError("; ".join(f"{p.where}: {p.message} [{p.code}]" for p in report.errors))
    return header.tensors
