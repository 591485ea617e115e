"""ascend-adapters deepseek_v4: the `vllm.general_plugins` hook.

vLLM calls `register()` in every process it starts, so it stays idempotent and
cheap: lazy "module:Class" registration, no torch import. It registers

* the architecture ``DeepseekV4ForCausalLM`` -> this package's portable model,
  on platforms without vLLM's native DeepSeek-V4 path (CPU, Ascend NPU, any
  platform that is not CUDA/ROCm/XPU; ``ASCEND_ADAPTERS_FORCE_PORTABLE=1``
  forces it everywhere);
* a config parser for the ``hf`` format that reads ``model_type: deepseek_v4``
  with transformers' own ``DeepseekV4Config`` (accepting both the
  transformers-saved layout and DeepSeek's native keys) and hands every other
  model to vLLM's stock parser unchanged;
* the start-up policy (``policy.py``, on vLLM's per-architecture config hook):
  state sizing, limits, prefix caching refused.
"""

from __future__ import annotations

import os

ARCH = "DeepseekV4ForCausalLM"

# architecture name -> "module:Class"
ARCHITECTURES: dict[str, str] = {ARCH: "ascend_adapters.deepseek_v4.model:DeepseekV4ForCausalLM"}


def _native_path_available() -> bool:
    """True where vLLM's own DeepSeek-V4 kernels run (CUDA, ROCm, XPU)."""
    if os.environ.get("ASCEND_ADAPTERS_FORCE_PORTABLE", "").strip().lower() in {"1", "true", "yes", "on"}:
        return False
    try:
        from vllm.platforms import current_platform
    except Exception:  # pragma: no cover - vLLM missing entirely
        return False
    return bool(current_platform.is_cuda() or current_platform.is_rocm() or current_platform.is_xpu())


def register() -> None:
    if _native_path_available():
        return
    from ascend_adapters.common.registry import register_architectures
    from ascend_adapters.deepseek_v4 import policy
    from ascend_adapters.deepseek_v4.config import register_config

    register_config()
    register_architectures(ARCHITECTURES)
    policy.install()
