"""Helpers for `vllm.general_plugins` hooks.

vLLM calls every general plugin in the API process and again in each
engine-core and worker process, so registration must be idempotent and cheap:
architectures are registered with the lazy ``"module:Class"`` form, which
imports nothing until vLLM builds the model.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("ascend_adapters")


def register_architectures(arch_to_target: dict[str, str]) -> list[str]:
    """Register each ``architecture -> "module:Class"`` with vLLM's ModelRegistry.

    Returns the architectures registered by this call (already-registered
    ones pointing at the same target are left alone). An architecture already
    registered by someone else is overridden: that is the point of an
    out-of-tree adapter for a platform where the in-tree class cannot run.
    """
    from vllm import ModelRegistry

    done = []
    for arch, target in arch_to_target.items():
        if ":" not in target:
            raise ValueError(f"{arch}: target {target!r} must be 'module:Class'")
        existing = ModelRegistry.models.get(arch) if hasattr(ModelRegistry, "models") else None
        if existing is not None and _target_of(existing) == target:
            continue
        ModelRegistry.register_model(arch, target)
        done.append(arch)
    if done:
        logger.debug("ascend_adapters registered %s", ", ".join(done))
    return done


def _target_of(registered) -> str | None:
    module = getattr(registered, "module_name", None)
    cls = getattr(registered, "class_name", None)
    return f"{module}:{cls}" if module and cls else None
