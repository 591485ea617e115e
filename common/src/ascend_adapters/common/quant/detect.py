"""Automatic selection of the ``modelslim`` quantization for ``vllm serve DIR``.

vLLM 0.32 picks a checkpoint's quantization method only from the HF config's
``quantization_config`` (``config.json``, or ``hf_quant_config.json``); a
ModelSlim export has neither: its ``config.json`` is the float model's, next to
``quant_model_description.json``. Without writing into the model directory,
the one public extension point that sees the directory before the method is
chosen is vLLM's config-parser registry (``register_config_parser``): this
module registers, for the default ``hf`` format, a parser that delegates to
the parser registered before it and, when the directory holds a description
and the config has no ``quantization_config``, adds
``{"quant_method": "modelslim"}`` to the *in-memory* config. Nothing on disk
changes, and every other checkpoint parses exactly as before.

Hand-off (native first): where the platform reads ModelSlim exports itself
(vllm-ascend's method ``ascend``: it detects the same description file in
``NPUPlatform.check_and_update_config`` and its ``override_quantization_method``
claims only configs whose ``quant_method`` is empty) and the architecture is
not served by one of this project's adapters, nothing is injected: the export
goes to the platform. ``modelslim`` serves the adapters' own classes and
platforms without ModelSlim support (CPU, vllm-plugin-FL).
``ascend-adapters status --model DIR`` prints the decision and its reason.

Opt out with ``ASCEND_ADAPTERS_MODELSLIM_AUTO=0`` (then pass
``--quantization modelslim``, which works either way).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ascend_adapters.common.flags import env_flag
from ascend_adapters.common.quant.description import DESCRIPTION_FILE

logger = logging.getLogger("ascend_adapters")

AUTO_ENV = "ASCEND_ADAPTERS_MODELSLIM_AUTO"


# vllm-ascend's ModelSlim support: this module, with the description file name and the override hook in it.
PLATFORM_MODELSLIM_MODULE = "quantization/modelslim_config.py"
PLATFORM_MODELSLIM_METHOD = "ascend"


def auto_enabled() -> bool:
    return env_flag(AUTO_ENV, default=True)


def platform_modelslim(platform=None) -> str | None:
    """The running platform's own ModelSlim method (``"ascend"`` on vllm-ascend), or None.

    Read from the platform plugin's source as text (nothing imported): its ModelSlim config module must
    name the description file and define ``override_quantization_method``.
    """
    import importlib.util

    from ascend_adapters.common.registry import _current_platform, _platform_package

    platform = platform if platform is not None else _current_platform()
    pkg = _platform_package(platform) if platform is not None else None
    spec = importlib.util.find_spec(pkg) if pkg else None
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(list(spec.submodule_search_locations)[0]) / PLATFORM_MODELSLIM_MODULE).read_text(encoding="utf-8")
    except OSError:
        return None
    if DESCRIPTION_FILE in text and "override_quantization_method" in text:
        return PLATFORM_MODELSLIM_METHOD
    return None


def _served_by_adapter(arch: str | None) -> str | None:
    """The adapter class registered for ``arch``, if one of this project's adapters serves it."""
    if not arch:
        return None
    from ascend_adapters.common.registry import _registered_target

    target = _registered_target(arch, exclude_ours=False)
    return target if target and target.startswith("ascend_adapters.") else None


def quant_decision(model, config_dict: dict) -> tuple[str | None, str]:
    """``(method, why)`` for a model directory: ``modelslim``, the platform's method, or None (not ours)."""
    from ascend_adapters.common.quant.config import QUANT_METHOD

    existing = config_dict.get("quantization_config")
    if existing is not None:
        method = existing.get("quant_method") if isinstance(existing, dict) else None
        return method or None, f"config.json has a quantization_config (quant_method {method!r}): left as it is"
    try:
        path = Path(model)
        if not (path.is_dir() and (path / DESCRIPTION_FILE).is_file()):
            return None, f"no {DESCRIPTION_FILE}: not a ModelSlim export"
    except (TypeError, OSError):
        return None, "not a local directory"
    if not auto_enabled():
        return None, f"{AUTO_ENV}=0: pass --quantization {QUANT_METHOD} yourself"
    archs = config_dict.get("architectures") or [None]
    arch = archs[0]
    adapter = _served_by_adapter(arch)
    native = platform_modelslim()
    if native is not None and adapter is None:
        return native, (
            f"the platform reads ModelSlim exports itself (method {native!r}) and serves {arch}: "
            f"nothing injected, the export goes to the platform"
        )
    if adapter is not None:
        return QUANT_METHOD, f"{arch} is served by this project's adapter ({adapter})"
    return QUANT_METHOD, "the platform has no ModelSlim support of its own"


def modelslim_marker(model, config_dict: dict) -> dict | None:
    """The quantization_config to inject for ``model`` (a local dir), or None to leave it alone.

    Public so that another config parser (e.g. a model adapter's) can apply the same rule.
    """
    from ascend_adapters.common.quant.config import QUANT_METHOD

    method, why = quant_decision(model, config_dict)
    if method != QUANT_METHOD or config_dict.get("quantization_config") is not None:
        if method is not None and config_dict.get("quantization_config") is None:
            logger.info("ascend_adapters: %s: %s", model, why)
        return None
    return {"quant_method": QUANT_METHOD, "model_dir": str(Path(model).resolve())}


def register_parser() -> bool:
    """Wrap the registered ``hf`` config parser (idempotent). Returns True if it registered now."""
    from vllm.transformers_utils.config import get_config_parser, register_config_parser

    base = type(get_config_parser("hf"))
    if getattr(base, "_ascend_adapters_modelslim", False):
        return False

    class ModelSlimAwareHFConfigParser(base):
        """``hf`` config parser that marks ModelSlim exports (see ascend_adapters.common.quant.detect)."""

        _ascend_adapters_modelslim = True

        def parse(self, model, trust_remote_code, revision=None, code_revision=None, **kwargs):
            config_dict, config = super().parse(
                model, trust_remote_code, revision=revision, code_revision=code_revision, **kwargs
            )
            marker = modelslim_marker(model, config_dict)
            if marker is not None:
                logger.info(
                    "ascend_adapters: %s holds %s; selecting quantization %r",
                    model,
                    DESCRIPTION_FILE,
                    marker["quant_method"],
                )
                config_dict = {**config_dict, "quantization_config": marker}
            return config_dict, config

    # Silence vLLM's "already registered" warning: replacing the default is the intent here.
    vlog = logging.getLogger("vllm.transformers_utils.config")
    old = vlog.level
    vlog.setLevel(logging.ERROR)
    try:
        register_config_parser("hf")(ModelSlimAwareHFConfigParser)
    finally:
        vlog.setLevel(old)
    return True
