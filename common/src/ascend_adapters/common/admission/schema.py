"""The manifest's closed JSON schema and a small validator for it.

Every object is closed: an unknown key or a missing key is an error at every
level. Errors name the JSON path of the offending field, e.g.
``manifest.files[3].sha256``.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable

from ascend_adapters.common.admission.report import Report
from ascend_adapters.common.admission.safetensors_header import DTYPE_SIZES
from ascend_adapters.common.admission.tree import relpath_problem
from ascend_adapters.common.versions import COMPONENTS

FORMAT = "ascend-adapters-admission-manifest"
VERSION = 1

_HEX64 = re.compile(r"[0-9a-f]{64}")
_ID = re.compile(r"sha256:[0-9a-f]{64}")

Validator = Callable[[object, str, Report], None]


def _err(report: Report, where: str, message: str) -> None:
    report.error("manifest-schema", where, message)


def const(expected) -> Validator:
    def v(x, where, report):
        if type(x) is not type(expected) or x != expected:
            _err(report, where, f"must be {expected!r}, is {x!r}")

    return v


def string(pattern: re.Pattern | None = None, what: str = "") -> Validator:
    def v(x, where, report):
        if not isinstance(x, str):
            _err(report, where, f"must be a string, is {type(x).__name__}")
        elif pattern is not None and not pattern.fullmatch(x):
            _err(report, where, f"must be {what}, is {x!r}")

    return v


def nonneg_int(x, where, report):
    if not isinstance(x, int) or isinstance(x, bool) or x < 0:
        _err(report, where, f"must be a non-negative integer, is {x!r}")


def relpath(x, where, report):
    if not isinstance(x, str):
        _err(report, where, f"must be a string, is {type(x).__name__}")
        return
    problem = relpath_problem(x)
    if problem:
        report.error("manifest-path-unsafe", where, f"{x!r}: {problem}")


def dtype(x, where, report):
    if x not in DTYPE_SIZES:
        _err(report, where, f"dtype {x!r} not in {sorted(DTYPE_SIZES)}")


def version_spec(x, where, report):
    if x is None:
        return
    if not isinstance(x, str):
        _err(report, where, f"must be a version specifier string or null, is {x!r}")
        return
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
    except ImportError:  # pragma: no cover - packaging ships with pip-installed stacks
        _err(report, where, "the 'packaging' distribution is needed to read version ranges")
        return
    try:
        SpecifierSet(x)
    except InvalidSpecifier as exc:
        _err(report, where, f"invalid version specifier {x!r} ({exc})")


def nullable(inner: Validator) -> Validator:
    def v(x, where, report):
        if x is not None:
            inner(x, where, report)

    return v


def list_of(inner: Validator) -> Validator:
    def v(x, where, report):
        if not isinstance(x, list):
            _err(report, where, f"must be a list, is {type(x).__name__}")
            return
        for i, item in enumerate(x):
            inner(item, f"{where}[{i}]", report)

    return v


def map_of(inner: Validator) -> Validator:
    def v(x, where, report):
        if not isinstance(x, dict):
            _err(report, where, f"must be an object, is {type(x).__name__}")
            return
        for k, item in x.items():
            inner(item, f"{where}.{k}", report)

    return v


def obj(fields: dict[str, Validator]) -> Validator:
    def v(x, where, report):
        if not isinstance(x, dict):
            _err(report, where, f"must be an object, is {type(x).__name__}")
            return
        for k in x:
            if k not in fields:
                _err(report, f"{where}.{k}", "unknown key")
        for k, inner in fields.items():
            if k not in x:
                _err(report, f"{where}.{k}", "missing key")
            else:
                inner(x[k], f"{where}.{k}", report)

    return v


MANIFEST = obj(
    {
        "format": const(FORMAT),
        "version": const(VERSION),
        "artifact": obj(
            {
                "id": string(_ID, "'sha256:' + 64 lowercase hex digits"),
                "model_type": nullable(string()),
                "architectures": list_of(string()),
            }
        ),
        "files": list_of(
            obj({"path": relpath, "size": nonneg_int, "sha256": string(_HEX64, "64 lowercase hex digits")})
        ),
        "tensors": list_of(obj({"name": string(), "file": relpath, "dtype": dtype, "shape": list_of(nonneg_int)})),
        "modelslim": nullable(
            obj(
                {
                    "description": relpath,
                    "version": nullable(string()),
                    "model_quant_type": nullable(string()),
                    "type_counts": map_of(nonneg_int),
                    "undescribed_as_float": list_of(string()),
                }
            )
        ),
        "software": obj({k: version_spec for k in COMPONENTS}),
    }
)


def validate(manifest: object, report: Report, where: str = "manifest") -> bool:
    """Validate against the closed schema plus cross-field rules; True when valid."""
    before = len(report.errors)
    MANIFEST(manifest, where, report)
    if len(report.errors) > before:
        return False
    paths = [f["path"] for f in manifest["files"]]
    for p, n in sorted(collections.Counter(paths).items()):
        if n > 1:
            _err(report, f"{where}.files", f"path {p!r} listed more than once")
    for name, n in sorted(collections.Counter(t["name"] for t in manifest["tensors"]).items()):
        if n > 1:
            _err(report, f"{where}.tensors", f"tensor {name!r} listed more than once")
    declared = set(paths)
    for i, t in enumerate(manifest["tensors"]):
        if t["file"] not in declared:
            _err(report, f"{where}.tensors[{i}].file", f"{t['file']!r} is not among the declared files")
    ms = manifest["modelslim"]
    if ms is not None and ms["description"] not in declared:
        _err(report, f"{where}.modelslim.description", f"{ms['description']!r} is not among the declared files")
    return len(report.errors) == before
