"""Helpers for `vllm.general_plugins` hooks.

vLLM calls every general plugin in the API process and again in each
engine-core and worker process, so registration must be idempotent and cheap:
architectures are registered with the lazy ``"module:Class"`` form, which
imports nothing until vLLM builds the model.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable

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


# --- native first -------------------------------------------------------------------------------------
ADAPTER = "adapter"
NATIVE = "native"


@dataclasses.dataclass(frozen=True)
class Decision:
    """Who serves ``arch`` in this process: this project's ``adapter`` class or the platform's ``native`` one."""

    arch: str
    serves: str  # ADAPTER or NATIVE
    target: str | None  # "module:Class" that will serve, where known
    why: str


_DECISIONS: dict[str, Decision] = {}


def decide(
    arch: str,
    adapter_target: str,
    env: str,
    *,
    in_tree_native: Callable[[object], bool] | None = None,
) -> Decision:
    """Native first: does the running platform already serve ``arch``?

    In order:

    1. ``env`` (``ASCEND_ADAPTERS_<MODEL>``): ``adapter`` (or ``on``) forces this project's class,
       ``native`` (or ``off``) leaves the architecture to the platform; ``auto`` (default) goes on.
    2. A platform plugin's own registration: the class vLLM's ModelRegistry holds for ``arch`` comes
       from a plugin (not vLLM's in-tree models, not this project) -> native.
    3. What the platform is: the current platform's plugin package registers ``arch`` in its model
       registry module (e.g. ``vllm_ascend/models/__init__.py``) and that plugin's
       ``vllm.general_plugins`` hook is not filtered out by ``VLLM_PLUGINS`` -> native. This holds
       whatever order vLLM loads the general plugins in.
    4. ``in_tree_native(current_platform)``: vLLM's in-tree class has its own kernels there (CUDA) -> native.
    5. Otherwise (CPU, vllm-plugin-FL, an older vllm-ascend without the model) -> adapter.
    """
    from ascend_adapters.common.flags import env_choice

    choice = env_choice(env, extra=(ADAPTER, NATIVE, "force"))
    raw = os.environ.get(env, "").strip()
    if choice in ("on", ADAPTER, "force"):
        d = Decision(arch, ADAPTER, adapter_target, f"{env}={raw} forces the adapter")
    elif choice in ("off", NATIVE):
        d = Decision(
            arch, NATIVE, _registered_target(arch, exclude_ours=True), f"{env}={raw} leaves it to the platform"
        )
    else:
        d = _platform_decision(arch, adapter_target, in_tree_native)
    _DECISIONS[arch] = d
    logger.info("ascend_adapters: %s served by %s (%s)", arch, d.serves, d.why)
    return d


def decisions() -> dict[str, Decision]:
    """Decisions taken in this process so far (``status``, the ModelSlim hand-off)."""
    return dict(_DECISIONS)


def _platform_decision(arch, adapter_target, in_tree_native) -> Decision:
    target = _registered_target(arch, exclude_ours=True)
    if target is not None and not _is_in_tree(target):
        return Decision(arch, NATIVE, target, f"a platform plugin registered {target}")
    served = platform_registers(arch)
    if served is not None:
        return Decision(arch, NATIVE, served[0], served[1])
    platform = _current_platform()
    if platform is not None and in_tree_native is not None and in_tree_native(platform):
        name = type(platform).__name__
        return Decision(arch, NATIVE, target, f"vLLM's own class has native kernels on {name}")
    name = type(platform).__name__ if platform is not None else "no vLLM platform"
    return Decision(arch, ADAPTER, adapter_target, f"{name} does not serve {arch}")


def _current_platform():
    try:
        from vllm.platforms import current_platform

        return current_platform
    except Exception:  # pragma: no cover - vLLM missing
        return None


def _platform_package(platform) -> str | None:
    module = type(platform).__module__ or ""
    top = module.split(".")[0]
    return None if top in ("", "vllm", "builtins") else top


# The module inside a platform plugin package that registers its model classes (vllm-ascend's layout).
PLATFORM_MODEL_MODULE = "models/__init__.py"


def platform_registers(arch: str, platform=None) -> tuple[str, str] | None:
    """``(target, why)`` when the current platform's plugin package registers ``arch`` itself.

    Reads the package's model registry module as text (nothing is imported), so the answer does not
    depend on whether that plugin's hook has already run in this process.
    """
    import importlib.util
    import re
    from pathlib import Path

    platform = platform if platform is not None else _current_platform()
    pkg = _platform_package(platform) if platform is not None else None
    if pkg is None:
        return None
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(list(spec.submodule_search_locations)[0]) / PLATFORM_MODEL_MODULE
    try:
        text = source.read_text(encoding="utf-8")
    except OSError:
        return None
    m = re.search(r"register_model\(\s*[\"']" + re.escape(arch) + r"[\"']\s*,\s*[\"']([^\"']+)[\"']", text)
    if m is None:
        return None
    hooks = _plugin_hooks(pkg)
    allowed = _vllm_plugins_filter()
    if allowed is not None and hooks and not (set(hooks) & allowed):
        return None
    return m.group(1), f"platform {type(platform).__name__} ({pkg}) registers {arch} in {pkg}/{PLATFORM_MODEL_MODULE}"


def _plugin_hooks(pkg: str) -> list[str]:
    import importlib.metadata as md

    return [
        ep.name for ep in md.entry_points(group="vllm.general_plugins") if ep.value.split(":")[0].split(".")[0] == pkg
    ]


def _vllm_plugins_filter() -> set[str] | None:
    raw = os.environ.get("VLLM_PLUGINS")
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def _registered_target(arch: str, exclude_ours: bool) -> str | None:
    try:
        from vllm import ModelRegistry
    except Exception:  # pragma: no cover
        return None
    registered = getattr(ModelRegistry, "models", {}).get(arch)
    if registered is None:
        return None
    target = _target_of(registered)
    if target is None:
        cls = getattr(registered, "model_cls", None) or getattr(registered, "cls", None)
        target = f"{cls.__module__}:{cls.__qualname__}" if cls is not None else None
    if exclude_ours and target and target.startswith("ascend_adapters."):
        return None
    return target


def _is_in_tree(target: str) -> bool:
    return target.startswith("vllm.")


def register_native_first(
    arch_to_target: dict[str, str],
    env: str,
    *,
    in_tree_native: Callable[[object], bool] | None = None,
) -> list[Decision]:
    """``decide`` each architecture and register the adapter's class where it serves. Returns the decisions."""
    out = []
    for arch, target in arch_to_target.items():
        d = decide(arch, target, env, in_tree_native=in_tree_native)
        if d.serves == ADAPTER:
            register_architectures({arch: target})
        out.append(d)
    return out


def serving_report(load_plugins: bool = True) -> list[dict]:
    """For ``status``: per architecture of this project's adapters, which class serves it and why.

    Runs vLLM's general plugins as a server process would (so every hook, ours and the platform's,
    has registered), then reads vLLM's ModelRegistry and this process's decisions.
    """
    import importlib
    import importlib.metadata as md

    if load_plugins:
        import os

        from vllm.plugins import load_general_plugins

        from ascend_adapters.common.compat import ENGINE_OVERRIDE_ENV

        # status reports an out-of-range engine on its own line; it must not be stopped by the refusal
        saved = os.environ.get(ENGINE_OVERRIDE_ENV)
        os.environ[ENGINE_OVERRIDE_ENV] = "on"
        try:
            load_general_plugins()
        finally:
            if saved is None:
                del os.environ[ENGINE_OVERRIDE_ENV]
            else:
                os.environ[ENGINE_OVERRIDE_ENV] = saved
    rows = []
    for ep in sorted(md.entry_points(group="vllm.general_plugins"), key=lambda e: e.name):
        module_name = ep.value.split(":")[0]
        if not module_name.startswith("ascend_adapters.") or module_name.startswith("ascend_adapters.common"):
            continue
        try:
            hook_module = importlib.import_module(module_name)
            archs = getattr(hook_module, "ARCHITECTURES", {})
        except Exception as exc:  # status must always answer
            rows.append({"arch": None, "adapter": module_name, "serves": "error", "target": None, "why": repr(exc)})
            continue
        for arch, ours in archs.items():
            row = _row(arch, ours, module_name)
            if row["serves"] == ADAPTER:
                row["capabilities"] = capabilities(
                    ours,
                    getattr(hook_module, "SPECULATIVE_METHODS", ()),
                    getattr(hook_module, "SPLITTING_OPS", ()),
                )
                if getattr(hook_module, "STATUS_NOTES", None):
                    row["notes"] = status_notes(hook_module.STATUS_NOTES)
            rows.append(row)
    return rows


def capabilities(target: str, speculative_methods: tuple[str, ...], splitting_ops: tuple[str, ...] = ()) -> dict:
    """What the adapter's class serves beyond one eager rank: pipeline parallelism (vLLM's
    ``SupportsPP``, read from the class), the speculative decoding methods its start-up policy
    accepts, and its graph mode: the classes of its model module that vLLM compiles (those under
    ``@support_torch_compile``) and the ops vLLM runs eagerly between the compiled pieces."""
    import importlib

    from ascend_adapters.common.policy import adapter_splitting_ops

    try:
        from vllm.model_executor.models.interfaces import supports_pp

        module_name, _, cls_name = target.partition(":")
        module = importlib.import_module(module_name)
        pp = bool(supports_pp(getattr(module, cls_name)))
    except Exception as exc:  # status must always answer
        return {
            "pipeline_parallel": f"unknown ({type(exc).__name__}: {exc})",
            "speculative_methods": list(speculative_methods),
        }
    try:
        from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

        compiled = sorted(
            name
            for name, obj in vars(module).items()
            if isinstance(obj, type)
            and obj.__module__ == module_name
            and issubclass(obj, TorchCompileWithNoGuardsWrapper)
        )
    except Exception as exc:  # status must always answer
        compiled = f"unknown ({type(exc).__name__}: {exc})"
    return {
        "pipeline_parallel": pp,
        "speculative_methods": list(speculative_methods),
        "compiled_classes": compiled,
        "splitting_ops": adapter_splitting_ops(splitting_ops) if splitting_ops else [],
    }


def status_notes(spec: str) -> list[str]:
    """The lines an adapter adds to ``status`` under each architecture it serves.

    An adapter's hook module may set ``STATUS_NOTES = "module:function"`` (a string, so importing
    the hook stays cheap); ``function()`` returns a list of lines. A failure becomes one line.
    """
    import importlib

    try:
        module_name, _, attr = spec.partition(":")
        lines = getattr(importlib.import_module(module_name), attr)()
        return [str(line) for line in lines]
    except Exception as exc:  # status must always answer
        return [f"status notes {spec} unavailable ({type(exc).__name__}: {exc})"]


def _row(arch: str, ours: str, module_name: str) -> dict:
    target = _registered_target(arch, exclude_ours=False)
    d = _DECISIONS.get(arch)
    if d is None:
        serves = ADAPTER if target == ours else NATIVE
        why = "always registered: no platform serves it" if target == ours else f"{target or 'nothing'} is registered"
    elif d.serves == ADAPTER and target != ours:
        serves, why = NATIVE, f"{d.why}, but {target} was registered after it (plugin order)"
    else:
        serves, why = d.serves, d.why
    served_by = ours if serves == ADAPTER else (target or d and d.target)
    return {"arch": arch, "adapter": module_name, "serves": serves, "target": served_by, "why": why}
