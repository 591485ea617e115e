"""ascend-adapters glm_dsa: the `vllm.general_plugins` hook.

vLLM calls `register()` in every process it starts, so it stays idempotent and
cheap: lazy "module:Class" registration, no model import.

``ASCEND_ADAPTERS_GLM_DSA`` decides whether this adapter's class serves
``GlmMoeDsaForCausalLM``: ``auto`` (default) on platforms without vLLM's native
sparse-MLA path (Ascend NPU, CPU; i.e. not CUDA/ROCm), ``on`` everywhere,
``off`` never (vLLM's own class). See ``config.py`` for the attention-path switch.
"""

from __future__ import annotations

import os

# architecture name -> "module:Class"
ARCHITECTURES: dict[str, str] = {
    "GlmMoeDsaForCausalLM": "ascend_adapters.glm_dsa.model:GlmMoeDsaForCausalLM",
}

ENABLE_ENV = "ASCEND_ADAPTERS_GLM_DSA"


def enabled() -> bool:
    raw = os.environ.get(ENABLE_ENV, "auto").strip().lower()
    if raw in {"0", "off", "false", "no"}:
        return False
    if raw in {"1", "on", "true", "yes", "force"}:
        return True
    if raw not in {"", "auto"}:
        raise ValueError(f"{ENABLE_ENV}={raw!r}: expected auto, on or off")
    from vllm.platforms import current_platform

    # CUDA/ROCm builds of vLLM have native sparse-MLA kernels for this architecture
    return not current_platform.is_cuda_alike()


def register() -> None:
    if not enabled():
        return
    from ascend_adapters.common.registry import register_architectures
    from ascend_adapters.glm_dsa import arch, policy

    register_architectures(ARCHITECTURES)
    arch.install()
    policy.install()
