"""ascend-adapters glm_dsa: the `vllm.general_plugins` hook.

vLLM calls `register()` in every process it starts, so it stays idempotent and
cheap: lazy "module:Class" registration, no torch import.

Set ``ASCEND_ADAPTERS_GLM_DSA_DISABLE=1`` to keep vLLM's own class (platforms
with a native sparse-MLA path); see ``config.py`` for the attention-path switch.
"""

from __future__ import annotations

import os

# architecture name -> "module:Class"
ARCHITECTURES: dict[str, str] = {
    "GlmMoeDsaForCausalLM": "ascend_adapters.glm_dsa.model:GlmMoeDsaForCausalLM",
}

DISABLE_ENV = "ASCEND_ADAPTERS_GLM_DSA_DISABLE"


def register() -> None:
    if os.environ.get(DISABLE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}:
        return
    from ascend_adapters.common.registry import register_architectures

    register_architectures(ARCHITECTURES)
    from ascend_adapters.glm_dsa.arch import install

    install()
