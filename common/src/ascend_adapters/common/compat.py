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


def enable_cpu_mamba_state_copy() -> bool:
    """Let vLLM's "align" prefix caching of recurrent state copy state blocks without Triton.

    In ``mamba_cache_mode="align"`` the model runner copies each request's state from the
    block of its previous step to the block of this step (``mamba_utils.preprocess_mamba``)
    with a Triton ``batch_memcpy`` kernel (same function, same arguments: source pointers,
    destination pointers, byte sizes, in vLLM 0.27.1 through 0.32). Without Triton (CPU
    builds) that kernel cannot run; on the CPU platform this replaces it with the same
    byte copies done by ``memmove``. Elsewhere (NPU, GPU) nothing changes. Idempotent;
    returns whether the CPU copy is installed.
    """
    import ctypes

    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.v1.worker import mamba_utils

    if getattr(mamba_utils.batch_memcpy, "_ascend_adapters_cpu", False):
        return True

    def batch_memcpy(src_ptrs, dst_ptrs, sizes):
        for src, dst, size in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()):
            ctypes.memmove(dst, src, size)

    batch_memcpy._ascend_adapters_cpu = True
    mamba_utils.batch_memcpy = batch_memcpy
    return True
