"""DeepSeek-V4's multi-token-prediction layer as vLLM's MTP drafter (``--speculative-config '{"method": "mtp"}'``).

DeepSeek-V4 releases carry one MTP layer, ``mtp.0.*`` in DeepSeek's native names: a decoder layer
(attention with its own state, MoE, the two hyper-connection mixes) plus ``enorm``, ``hnorm``,
``e_proj``, ``h_proj``, its own hyper-connection head (``hc_head_fn/base/scale``) and ``norm``. At
position ``i`` it takes the target's residual streams ``S_i`` (``[hc_mult, hidden]``, before the
target's hc head) and the embedding of token ``i + 1``:

    X_i = h_proj(hnorm(S_i)) + e_proj(enorm(embed(t_{i+1})))    (the embedding term added to every stream)
    S'  = layer(X)
    logits = head(norm(hc_head(S')))

``S'`` (flattened to ``[tokens, hc_mult * hidden]``) is the hidden state of the next draft step, which
reuses the same layer. vLLM's proposer drives it through ``common.mtp``'s scaffold (the shared head, the
layer lookup, the target's embedding and head installed by the proposer; the embedding at position 0
zeroed): it reads the target's streams through ``DeepseekV4ForCausalLM.get_mtp_target_hidden_states``
(and widens its buffer to ``hc_mult * hidden`` when the draft config has ``compress_ratios`` and
``hc_mult``), gives the layer's attention a state page of its own and builds its metadata with the
layer's backend.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.fused_moe import fused_moe_make_expert_params_mapping
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.utils import maybe_prefix

from ascend_adapters.common.loading import load_checkpoint, load_module_tensors
from ascend_adapters.common.mtp import MTPDrafter, MultiTokenPredictor, SharedHead, compile_drafter
from ascend_adapters.deepseek_v4.config import MTP_LAYER_TYPE, MTP_MLP_TYPE, RELEASE_QUANT_ATTR
from ascend_adapters.deepseek_v4.dequant import dequantize_release
from ascend_adapters.deepseek_v4.mhc import hc_ops
from ascend_adapters.deepseek_v4.model import DeepseekV4DecoderLayer
from ascend_adapters.deepseek_v4.remap import (
    EXPERT_DOWN,
    EXPERT_GATE,
    EXPERT_UP,
    STACKED_PARAMS,
    mtp_skip_rules,
    mtp_weights_mapper,
)


def draft_config(vllm_config: VllmConfig):
    """The draft's config, with the MTP layers' attention and MoE types appended to the per-layer lists
    (the layer classes read their type by layer id)."""
    spec = vllm_config.speculative_config
    base = (
        spec.draft_model_config.hf_config
        if spec is not None and spec.draft_model_config
        else (vllm_config.model_config.hf_config)
    )
    config = copy.copy(base)
    n = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    config.layer_types = list(base.layer_types)[: base.num_hidden_layers] + [MTP_LAYER_TYPE] * n
    config.mlp_layer_types = list(base.mlp_layer_types)[: base.num_hidden_layers] + [MTP_MLP_TYPE] * n
    return config


class DeepseekV4MTPLayer(DeepseekV4DecoderLayer):
    def __init__(self, quant_config, config, layer_idx: int, prefix: str):
        super().__init__(config, layer_idx, quant_config, prefix)
        h, n = config.hidden_size, config.hc_mult
        self.config = config
        self.enorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.e_proj = ReplicatedLinear(h, h, bias=False, quant_config=quant_config, prefix=f"{prefix}.e_proj")
        self.h_proj = ReplicatedLinear(h, h, bias=False, quant_config=quant_config, prefix=f"{prefix}.h_proj")
        self.hc_head = nn.Module()
        self.hc_head.hc_fn = nn.Parameter(torch.empty(n, n * h, dtype=torch.float32), requires_grad=False)
        self.hc_head.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32), requires_grad=False)
        self.hc_head.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
        self.hc_head_op = hc_ops(config, torch.get_default_dtype()).head
        self.shared_head = SharedHead(config)

    def predict(self, input_ids, positions, inputs_embeds, previous_streams):
        h = self.config.hidden_size
        streams = previous_streams.view(-1, self.config.hc_mult, h)
        x = self.h_proj(self.hnorm(streams))[0] + self.e_proj(self.enorm(inputs_embeds))[0].unsqueeze(1)
        return self(x, positions, input_ids).flatten(1)

    def head_hidden(self, streams):
        streams = streams.view(-1, self.config.hc_mult, self.config.hidden_size)
        h = self.hc_head_op(
            streams,
            self.hc_head.hc_fn,
            self.hc_head.hc_base,
            self.hc_head.hc_scale,
            hc_eps=self.config.hc_eps,
            norm_eps=self.config.rms_norm_eps,
        )
        return self.shared_head(h)


class DeepseekV4MultiTokenPredictor(MultiTokenPredictor):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        config = draft_config(vllm_config)
        quant_config = vllm_config.quant_config
        if quant_config is not None:
            # a quantized export names the MTP layer mtp.K.*: the drafter's own copy of the quantization
            # config maps its description to the drafter's layer names, as vLLM maps the target's through
            # DeepseekV4ForCausalLM.hf_to_vllm_mapper (the config vLLM hands over, the target's, is left as is)
            quant_config = copy.deepcopy(quant_config)
            quant_config.apply_vllm_mapper(mtp_weights_mapper(config))
        super().__init__(
            config,
            lambda i, layer_prefix: DeepseekV4MTPLayer(quant_config, config, i, prefix=layer_prefix),
            what="DeepSeek-V4",
            prefix=prefix,
        )
        self.expert_mapping = fused_moe_make_expert_params_mapping(
            self,
            ckpt_gate_proj_name=EXPERT_GATE,
            ckpt_down_proj_name=EXPERT_DOWN,
            ckpt_up_proj_name=EXPERT_UP,
            num_experts=config.n_routed_experts,
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_module_tensors(
            self,
            weights,
            stacked_params=STACKED_PARAMS,
            expert_mapping=self.expert_mapping,
            num_experts=self.config.n_routed_experts,
        )


@compile_drafter
class DeepseekV4MTP(MTPDrafter):
    """vLLM's MTP drafter for ``DeepseekV4ForCausalLM`` checkpoints (see the module doc)."""

    packed_modules_mapping = {"wqkv_a": ["q_a_proj", "kv_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(DeepseekV4MultiTokenPredictor(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model")))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        release = getattr(self.config, RELEASE_QUANT_ATTR, None)
        if release is not None:  # DeepSeek's FP8/FP4 release: float weights from here on
            weights = dequantize_release(weights, tuple(release["weight_block_size"]))
        return load_checkpoint(
            self,
            weights,
            what="DeepSeek-V4 MTP",
            mapper=mtp_weights_mapper(self.config),
            skips=mtp_skip_rules(self.config),
            stacked_params=STACKED_PARAMS,
            expert_mapping=self.model.expert_mapping,
            required_buffers=lambda name: False,
        )
