"""Patches of vLLM for the CPU platform: what a CPU engine build cannot run, done another way.

Each patch applies only on the CPU platform and is idempotent; on NPU and GPU nothing changes.
"""

from __future__ import annotations


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
