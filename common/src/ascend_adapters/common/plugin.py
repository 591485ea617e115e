"""common's own `vllm.general_plugins` hook.

Runs in every vLLM process, before any model module is imported. It stays
cheap: nothing here imports torch unless a feature is enabled.
"""

from __future__ import annotations


def register() -> None:
    pass
