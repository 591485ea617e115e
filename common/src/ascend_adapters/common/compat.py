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


def mla_attention_spec(**kwargs):
    """vLLM's ``MLAAttentionSpec(**kwargs)``; ``max_tp_shards`` is dropped where the installed spec has no
    such field (vLLM 0.27.1 / 0.28). Decided by the dataclass's fields, not by the version number."""
    import dataclasses

    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    fields = {f.name for f in dataclasses.fields(MLAAttentionSpec)}
    if "max_tp_shards" not in fields:
        kwargs.pop("max_tp_shards", None)
    return MLAAttentionSpec(**kwargs)
