"""ascend-adapters rwkv7: the `vllm.general_plugins` hook.

vLLM calls `register()` in every process it starts, so it stays idempotent and
cheap: lazy "module:Class" registration of the model, plus the config class
(``model_type: rwkv7``), the World tokenizer class and the engine-config
checks (state-cache sizing; refusing pipeline parallelism, speculative
decoding and a head count that tensor parallelism cannot split).
"""

from __future__ import annotations

_MODEL = "ascend_adapters.rwkv7.model:Rwkv7ForCausalLM"

# architecture name -> "module:Class"
ARCHITECTURES: dict[str, str] = {
    "RWKV7ForCausalLM": _MODEL,  # flash-linear-attention's HF layout (released HF checkpoints)
    "Rwkv7ForCausalLM": _MODEL,
}


def register() -> None:
    from ascend_adapters.common.registry import register_architectures
    from ascend_adapters.rwkv7.config import register_config
    from ascend_adapters.rwkv7.tokenizer import register_tokenizer

    register_config()
    register_tokenizer()
    register_architectures(ARCHITECTURES)
    _register_engine_config()


def _register_engine_config() -> None:
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from ascend_adapters.rwkv7.policy import Rwkv7EngineConfig

    for arch in ARCHITECTURES:
        MODELS_CONFIG_MAP[arch] = Rwkv7EngineConfig
