"""vLLM QuantizationConfig for ModelSlim exports (registered as ``modelslim``).

Selected either explicitly (``--quantization modelslim``: vLLM reads
``quant_model_description.json`` from the model directory and passes it to
``from_config``) or automatically (the config parser in ``detect.py`` adds
``quantization_config = {"quant_method": "modelslim"}`` to the in-memory HF
config of a directory that holds a description; ``maybe_update_config`` then
reads the description from that directory).

Per layer (``get_quant_method``):

* linear layers: the type of ``prefix.weight`` (all fused shards must agree)
  -> W8A8 static / W8A8_DYNAMIC / FLOAT method;
* routed experts: the type of every ``experts.{e}.{gate,up,down}.weight``
  (all must agree) -> W8A8_DYNAMIC MoE method, or vLLM's unquantized method;
* vocabulary embeddings / lm_head: FLOAT only (vLLM's unquantized method);
* everything else (attention, norms): no quant method.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from ascend_adapters.common.quant.description import (
    DESCRIPTION_FILE,
    FLOAT,
    W8A8_DYNAMIC,
    Description,
    DescriptionError,
    check_export,
)

logger = logging.getLogger("ascend_adapters")

QUANT_METHOD = "modelslim"
#: Key under which an injected quantization_config may carry the description itself.
EMBEDDED_KEY = "modelslim_description"


class ModelSlimConfig(QuantizationConfig):
    """ModelSlim W8A8 / W8A8_DYNAMIC / FLOAT export."""

    def __init__(self, description: Description | None, model_dir: str | None = None):
        super().__init__()
        self.description = description
        self.model_dir = model_dir
        self._renames = []

    def __repr__(self) -> str:
        src = self.description.source if self.description else "<pending>"
        return f"ModelSlimConfig({src})"

    # -- vLLM's class interface -----------------------------------------------------------------
    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return [DESCRIPTION_FILE]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelSlimConfig:
        if config.get("quant_method") == QUANT_METHOD and not _looks_like_description(config):
            # Injected marker (auto-detection): the description is read in maybe_update_config,
            # unless it was embedded.
            embedded = config.get(EMBEDDED_KEY)
            desc = Description.from_dict(embedded, source="quantization_config") if embedded else None
            return cls(desc, model_dir=config.get("model_dir"))
        return cls(Description.from_dict(config, source=DESCRIPTION_FILE))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        return None

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None):
        path = Path(model_name)
        if path.is_dir():
            self.model_dir = str(path)
            if self.description is None or self.description.source == DESCRIPTION_FILE:
                self.description = Description.from_model_dir(path)
            check_export(path, self.description)
        if self.description is None:
            raise DescriptionError(f"{model_name}: no {DESCRIPTION_FILE} to read the ModelSlim quantization from")
        for fn in self._renames:
            self.description.rename(fn)
        logger.info(
            "ModelSlim quantization: %s (%s)", self.description.source, self.description.model_quant_type or "mixed"
        )

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        # Checkpoint names -> vLLM module names (models whose modules are named differently).
        from ascend_adapters.common import compat

        fn = compat.weights_mapper_fn(hf_to_vllm_mapper)
        self._renames.append(fn)
        if self.description is not None:
            self.description.rename(fn)

    # -- per layer ------------------------------------------------------------------------------
    def _require(self) -> Description:
        if self.description is None:
            raise DescriptionError(
                "ModelSlim quantization config has no description (maybe_update_config "
                "was not called with the model directory)"
            )
        return self.description

    def shard_prefixes(self, prefix: str) -> list[str]:
        """Checkpoint prefixes of the shards fused into module ``prefix`` (itself when not fused)."""
        head, _, last = prefix.rpartition(".")
        shards = self.packed_modules_mapping.get(last)
        if not shards:
            return [prefix]
        return [f"{head}.{s}" if head else s for s in shards]

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from vllm.model_executor.layers.fused_moe import RoutedExperts
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        desc = self._require()
        if isinstance(layer, LinearBase):
            from ascend_adapters.common.quant.linear import LINEAR_METHODS, ModelSlimFloatLinearMethod

            kind = desc.fused_type(prefix, self.shard_prefixes(prefix))
            if kind == FLOAT:
                return ModelSlimFloatLinearMethod(prefix)
            return LINEAR_METHODS[kind](prefix)
        if isinstance(layer, RoutedExperts):
            return self._moe_method(layer, prefix, desc)
        if isinstance(layer, VocabParallelEmbedding):
            kind = desc.layer_type(prefix)
            if kind != FLOAT:
                raise DescriptionError(
                    f"{prefix}.weight: quantization type {kind} is not supported for embeddings / lm_head (only FLOAT)"
                )
            return None
        return None

    def _moe_method(self, layer, prefix: str, desc: Description):
        names = (
            layer.ckpt_gate_proj_name,
            layer.ckpt_up_proj_name or layer.ckpt_gate_proj_name,
            layer.ckpt_down_proj_name,
        )
        projs = tuple(dict.fromkeys(names))
        n = (
            layer.moe_config.num_logical_experts
            if hasattr(layer.moe_config, "num_logical_experts")
            else layer.global_num_experts
        )
        prefixes = [f"{prefix}.{e}.{p}" for e in range(n) for p in projs]
        kinds: dict[str, list[str]] = {}
        for p in prefixes:
            kinds.setdefault(desc.layer_type(p), []).append(p)
        if len(kinds) > 1:
            listing = "; ".join(f"{k}: {v[0]}.weight (+{len(v) - 1} more)" for k, v in kinds.items())
            raise DescriptionError(
                f"{desc.source}: the experts of {prefix!r} have different quantization types "
                f"({listing}); one fused MoE layer needs one type"
            )
        kind = next(iter(kinds))
        if kind == FLOAT:
            return None
        if kind != W8A8_DYNAMIC:
            raise DescriptionError(
                f"{prefixes[0]}.weight: {kind} routed experts are not supported (only W8A8_DYNAMIC or FLOAT)"
            )
        from ascend_adapters.common.quant.moe import ModelSlimW8A8DynamicMoEMethod

        return ModelSlimW8A8DynamicMoEMethod(layer.moe_config, prefix, names)


def _looks_like_description(config: dict) -> bool:
    return any("." in k for k in config)
