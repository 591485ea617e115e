"""ModelSlim (msModelSlim) W8A8 quantization for vLLM.

* ``description``: ``quant_model_description.json`` parsing and start-up checks (no torch).
* ``config``: the vLLM QuantizationConfig ``modelslim``.
* ``linear`` / ``moe``: W8A8 static, W8A8_DYNAMIC and FLOAT linear methods; W8A8_DYNAMIC routed experts.
* ``kernels``: ``portable.py`` (exact integer arithmetic in torch) and ``npu.py`` (torch_npu),
  behind ``ascend_adapters.common.dispatch``.
* ``detect``: automatic selection for ``vllm serve DIR`` on a ModelSlim export.

``register()`` is called from common's vLLM plugin hook in every vLLM process.
"""

from __future__ import annotations

QUANT_METHOD = "modelslim"

_registered = False


def register() -> None:
    """Register the ``modelslim`` quantization config and the auto-detecting config parser (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config

    from ascend_adapters.common.quant.config import ModelSlimConfig
    from ascend_adapters.common.quant.detect import register_parser

    if QUANT_METHOD not in QUANTIZATION_METHODS:
        register_quantization_config(QUANT_METHOD)(ModelSlimConfig)
    register_parser()
    _registered = True
