"""Every difference between the vLLM engine versions this project supports.

Adapters and the quant layer import vLLM internals that moved or changed
between engine versions through this module only: no version checks
anywhere else. Reading the engine version imports nothing from vLLM.
"""

from __future__ import annotations

import functools

from packaging.version import Version

from ascend_adapters.common.versions import engine_distribution


@functools.lru_cache(maxsize=1)
def engine_version() -> Version | None:
    """The installed engine's release (local label such as ``+cpu`` or ``+empty`` dropped), or None."""
    found = engine_distribution()
    if found is None:
        return None
    return Version(Version(found[1]).base_version)


def engine_at_least(version: str) -> bool:
    current = engine_version()
    return current is not None and current >= Version(version)
