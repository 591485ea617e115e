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


def auto_enabled() -> bool:
    return env_flag(AUTO_ENV, default=True)


def modelslim_marker(model, config_dict: dict) -> dict | None:
    """The quantization_config to inject for ``model`` (a local dir), or None to leave it alone.

    Public so that another config parser (e.g. a model adapter's) can apply the same rule.
    """
    if not auto_enabled() or config_dict.get("quantization_config") is not None:
        return None
    try:
        path = Path(model)
        if not (path.is_dir() and (path / DESCRIPTION_FILE).is_file()):
            return None
    except (TypeError, OSError):
        return None
    from ascend_adapters.common.quant.config import QUANT_METHOD

    return {"quant_method": QUANT_METHOD, "model_dir": str(path.resolve())}


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
