"""ascend-adapters deepseek_v4: the `vllm.general_plugins` hook.

vLLM calls `register()` in every process it starts, so it stays idempotent and
cheap: lazy "module:Class" registration, no torch import.
"""

from __future__ import annotations

# architecture name -> "module:Class"; filled as the model lands.
ARCHITECTURES: dict[str, str] = {}


def register() -> None:
    from ascend_adapters.common.registry import register_architectures

    register_architectures(ARCHITECTURES)
