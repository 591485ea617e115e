"""GLM-5.x's multi-token-prediction layer as vLLM's MTP drafter (``--speculative-config '{"method": "mtp"}'``).

GLM-5.x checkpoints carry ``num_nextn_predict_layers`` (one) MTP layer after the main stack,
``model.layers.<num_hidden_layers>.*``: a full decoder layer plus ``enorm``, ``hnorm``, ``eh_proj`` and
``shared_head.norm`` (GLM-5.1 exports also copy ``embed_tokens`` and ``shared_head.head`` there). As in
DeepSeek-V3, whose MTP GLM-5 follows, the layer predicts the token after next: at position ``i`` it
takes the target's final hidden state ``h_i`` and the embedding of token ``i + 1``,

    x_i = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]),   y = layer(x),   logits = head(shared_head.norm(y)),

and its output ``y`` (before the norm) is the hidden state of the next draft step, which reuses the same
layer. vLLM's proposer drives it through ``common.mtp``'s scaffold (the shared head, the layer lookup, the
target's embedding and head installed by the proposer, so the checkpoint's copies are not loaded; the
embedding at position 0 zeroed); it gives the layer's attention a paged cache of its own and builds its
metadata with the layer's backend.

The decoder layer is the adapter's own (``GlmDsaDecoderLayer``: latent MLA with the DSA indexer, vLLM's
MoE); vLLM's DeepSeek-V3.2 MTP cannot run beside this adapter's attention. The MTP layer's attention is a
'full' DSA layer: it selects its own top-k at every draft step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.utils import maybe_prefix

from ascend_adapters.common.loading import load_checkpoint
from ascend_adapters.common.mtp import MTPDrafter, MultiTokenPredictor, SharedHead, compile_drafter
from ascend_adapters.glm_dsa import remap
from ascend_adapters.glm_dsa.config import AttentionMode, GlmDsaConfigError, choose_attention_mode
from ascend_adapters.glm_dsa.model import GlmDsaDecoderLayer, expert_params_mapping, load_layer_tensors
from ascend_adapters.glm_dsa.remap import STACKED_PARAMS


def draft_config(vllm_config: VllmConfig):
    """The draft's config (vLLM gives the drafter the target's ``vllm_config``; its draft model config
    is the checkpoint's own config with ``model_type`` ``deepseek_mtp``)."""
    spec = vllm_config.speculative_config
    if spec is not None and spec.draft_model_config is not None:
        return spec.draft_model_config.hf_text_config
    return vllm_config.model_config.hf_text_config


class GlmDsaMTPLayer(GlmDsaDecoderLayer):
    """A decoder layer (checkpoint names ``model.layers.<n>.{self_attn,mlp,...}``) with the MTP input
    projection and the shared head."""

    def __init__(self, vllm_config: VllmConfig, config, layer_idx: int, mode: AttentionMode, prefix: str):
        super().__init__(vllm_config, config, layer_idx, mode, prefix)
        h = config.hidden_size
        self.enorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(
            2 * h, h, bias=False, quant_config=vllm_config.quant_config, prefix=f"{prefix}.eh_proj"
        )
        self.shared_head = SharedHead(config)

    def predict(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor,
        previous_hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        x = torch.cat([self.enorm(inputs_embeds), self.hnorm(previous_hidden_states)], dim=-1)
        hidden_states, residual, _ = self(positions, self.eh_proj(x)[0], None, None)
        return hidden_states + residual

    def head_hidden(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.shared_head(hidden_states)


class GlmDsaMultiTokenPredictor(MultiTokenPredictor):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        config = draft_config(vllm_config)
        mode = choose_attention_mode(config, vllm_config.model_config.max_model_len)
        super().__init__(
            config,
            lambda i, layer_prefix: GlmDsaMTPLayer(vllm_config, config, i, mode, prefix=layer_prefix),
            what="GLM-DSA",
            prefix=prefix,
            error=GlmDsaConfigError,
        )
        self.mode = mode
        self.expert_params_mapping = expert_params_mapping(self, config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_layer_tensors(self, weights)


@compile_drafter
class GlmMoeDsaMTP(MTPDrafter):
    """vLLM's MTP drafter for ``GlmMoeDsaForCausalLM`` checkpoints (see the module doc)."""

    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(GlmDsaMultiTokenPredictor(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model")))
        self.skip_rules = remap.mtp_skip_rules(
            self.config.num_hidden_layers, self.model.num_mtp_layers, dense=self.model.mode is AttentionMode.DENSE
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = load_checkpoint(
            self,
            weights,
            what="GLM-DSA MTP",
            skips=self.skip_rules,
            stacked_params=STACKED_PARAMS,
            expert_mapping=self.model.expert_params_mapping,
            error=remap.GlmDsaWeightsError,
        )
        for layer in self.model.layers.values():
            layer.self_attn.absorb_weights()
        return loaded
