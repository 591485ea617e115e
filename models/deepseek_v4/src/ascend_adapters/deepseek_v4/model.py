"""DeepSeek-V4 (``DeepseekV4ForCausalLM``) for vLLM on platforms without the native path.

Reads like vLLM's llama.py: the decoder layer, then the model, then the causal-LM wrapper with
``load_weights``. The attention (``attention.py``) keeps its state in caches vLLM pages, one KV-cache
spec per cache (``memory.layer_caches``); all math goes through ``kernels`` (portable torch behind
common's dispatch layer), except the hyper-connection ops, which ``mhc.py`` takes from vLLM where the
engine's ops serve the call.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.fused_moe import fused_moe_make_expert_params_mapping
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    extract_layer_index,
    is_pp_missing_parameter,
    make_layers,
    maybe_prefix,
)
from vllm.sequence import IntermediateTensors

from ascend_adapters.common.loading import load_checkpoint, load_module_tensors
from ascend_adapters.deepseek_v4 import kernels as _kernels  # noqa: F401  (registers the portable ops)
from ascend_adapters.deepseek_v4.attention import DeepseekV4Attention
from ascend_adapters.deepseek_v4.config import RELEASE_QUANT_ATTR
from ascend_adapters.deepseek_v4.dequant import dequantize_release
from ascend_adapters.deepseek_v4.mhc import hc_ops
from ascend_adapters.deepseek_v4.moe import DeepseekV4FloatMoEMethod, DeepseekV4MoE
from ascend_adapters.deepseek_v4.remap import (
    EXPERT_DOWN,
    EXPERT_GATE,
    EXPERT_UP,
    MTP_REASON,
    STACKED_PARAMS,
    mtp_patterns,
    weights_mapper,
)


# ---------------------------------------------------------------- decoder
class _HC(nn.Module):
    def __init__(self, config):
        super().__init__()
        n = config.hc_mult
        # float32 whatever the model dtype, as the checkpoint and transformers keep them
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * config.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        self.iters, self.hc_eps, self.norm_eps = config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        self.ops = hc_ops(config, torch.get_default_dtype())

    def forward(self, streams):
        return self.ops.pre(
            streams,
            self.fn,
            self.base,
            self.scale,
            sinkhorn_iters=self.iters,
            hc_eps=self.hc_eps,
            norm_eps=self.norm_eps,
        )


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, quant_config=None, prefix: str = ""):
        super().__init__()
        self.self_attn = DeepseekV4Attention(config, layer_idx, quant_config, f"{prefix}.self_attn")
        self.mlp = DeepseekV4MoE(config, layer_idx, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = _HC(config)
        self.ffn_hc = _HC(config)
        self.hc_post = self.attn_hc.ops.post

    def forward(self, streams, positions, input_ids):
        post, comb, collapsed = self.attn_hc(streams)
        attn = self.self_attn(self.input_layernorm(collapsed), positions)
        streams = self.hc_post(streams, attn, post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        mlp = self.mlp(self.post_attention_layernorm(collapsed), input_ids)
        return self.hc_post(streams, mlp, post, comb)


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0}
)
class DeepseekV4Model(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        self.config = config
        self.hc_mult = config.hc_mult
        pp = get_pp_group()
        # Pipeline stages: embeddings on the first, norm + hc_head on the last; the mHC streams
        # ([tokens, hc_mult, hidden]) travel between them as intermediate tensors.
        if pp.is_first_rank:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "embed_tokens")
            )
        else:
            self.embed_tokens = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: DeepseekV4DecoderLayer(config, extract_layer_index(prefix), quant_config, prefix),
            prefix=maybe_prefix(prefix, "layers"),
        )
        if pp.is_last_rank:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.hc_head = nn.Module()
            n, f32 = config.hc_mult, torch.float32
            self.hc_head.hc_fn = nn.Parameter(torch.empty(n, n * config.hidden_size, dtype=f32))
            self.hc_head.hc_base = nn.Parameter(torch.zeros(n, dtype=f32))
            self.hc_head.hc_scale = nn.Parameter(torch.ones(1, dtype=f32))
            self.hc_head_op = hc_ops(config, torch.get_default_dtype()).head
            # The MTP drafter reads the streams before the hc head (get_mtp_target_hidden_states).
            spec = vllm_config.speculative_config
            if spec is not None and spec.method == "mtp":
                rows = vllm_config.scheduler_config.max_num_batched_tokens
                self.register_buffer("mtp_streams", torch.empty(rows, n * config.hidden_size), persistent=False)
        else:
            self.norm = PPMissingLayer()
            self.hc_head = PPMissingLayer()
        self.expert_mapping = fused_moe_make_expert_params_mapping(
            self,
            ckpt_gate_proj_name=EXPERT_GATE,
            ckpt_down_proj_name=EXPERT_DOWN,
            ckpt_up_proj_name=EXPERT_UP,
            num_experts=config.n_routed_experts,
        )

    def make_empty_intermediate_tensors(
        self, batch_size: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        shape = (batch_size, self.hc_mult, self.config.hidden_size)
        return IntermediateTensors({"hidden_states": torch.zeros(shape, dtype=dtype, device=device)})

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        if get_pp_group().is_first_rank:
            x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
            streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        else:
            streams = intermediate_tensors["hidden_states"]
        # every stage gets the token ids (hash-routed layers read tid2eid[token])
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            streams = layer(streams, positions, input_ids)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": streams})
        if hasattr(self, "mtp_streams"):
            self.mtp_streams[: streams.shape[0]].copy_(streams.flatten(1))
        h = self.hc_head_op(
            streams,
            self.hc_head.hc_fn,
            self.hc_head.hc_base,
            self.hc_head.hc_scale,
            hc_eps=self.config.hc_eps,
            norm_eps=self.config.rms_norm_eps,
        )
        return self.norm(h)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Mapped names (see remap.py): fused shards and routed experts stacked the vLLM way (another
        stage's tensors never reach here: the checkpoint loader skips them with the reason)."""
        return load_module_tensors(
            self,
            weights,
            stacked_params=STACKED_PARAMS,
            expert_mapping=self.expert_mapping,
            num_experts=self.config.n_routed_experts,
        )


class DeepseekV4ForCausalLM(nn.Module, SupportsPP):
    # checkpoint names -> this model's; vLLM renames a ModelSlim description with it too
    hf_to_vllm_mapper = weights_mapper()
    # fused module -> the shard names its checkpoint tensors (and description entries) keep
    packed_modules_mapping = {"wqkv_a": ["q_a_proj", "kv_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        quant_config = vllm_config.quant_config
        self.hf_to_vllm_mapper = weights_mapper(config)  # + MTP layers past num_hidden_layers
        self.model = DeepseekV4Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        pp = get_pp_group()
        if pp.is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        else:
            self.lm_head = PPMissingLayer()
        if getattr(config, "tie_word_embeddings", False):
            if pp.world_size > 1:
                raise ValueError(
                    "DeepSeek-V4 with tie_word_embeddings: pipeline parallelism is not supported (the head "
                    "would need the embedding of the first stage on the last)"
                )
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        if quant_config is not None and getattr(quant_config, "description", None) is not None:
            _check_description_covered(self, quant_config)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def get_mtp_target_hidden_states(self) -> torch.Tensor | None:
        """What vLLM's proposer feeds the MTP drafter: the last step's streams before the hc head,
        ``[tokens, hc_mult * hidden]`` (rows past the step's tokens are stale)."""
        return getattr(self.model, "mtp_streams", None)

    # -- weights -----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        release = getattr(self.config, RELEASE_QUANT_ATTR, None)
        if release is not None:  # DeepSeek's FP8/FP4 release: float weights from here on
            weights = dequantize_release(weights, tuple(release["weight_block_size"]))
        return load_checkpoint(
            self,
            weights,
            what="DeepSeek-V4",
            mapper=self.hf_to_vllm_mapper,
            skips={p.pattern: MTP_REASON for p in mtp_patterns(self.config)},
            stacked_params=STACKED_PARAMS,
            expert_mapping=self.model.expert_mapping,
            required_buffers=lambda name: name.endswith(".tid2eid"),
        )


def _check_description_covered(model: nn.Module, quant_config) -> None:
    """Every quantized entry of the description must land on a module that applies it."""
    from vllm.model_executor.layers.linear import LinearBase

    covered = set()
    for name, mod in model.named_modules():
        if isinstance(mod, LinearBase) and getattr(mod, "quant_config", None) is not None:
            covered.update(quant_config.shard_prefixes(name))
        if isinstance(mod, DeepseekV4MoE) and not isinstance(mod.routed.quant_method, DeepseekV4FloatMoEMethod):
            covered.update(
                f"{name}.experts.{e}.{p}" for e in range(mod.n_experts) for p in ("gate_proj", "up_proj", "down_proj")
            )
    desc = quant_config.description
    mtp = mtp_patterns(model.config)  # skipped on load, quantized or not

    def elsewhere(p: str) -> bool:  # an MTP layer, or a layer of another pipeline stage
        return any(r.search(p) for r in mtp) or is_pp_missing_parameter(p, model)

    stray = sorted(p for p in desc.quantized_weights() if p not in covered and not elsewhere(p))
    if stray:
        raise ValueError(
            f"{desc.source}: {stray[0]}.weight is {desc.quantized_weights()[stray[0]]}, but the "
            f"DeepSeek-V4 module it belongs to runs in float only ({len(stray)} such: "
            f"{stray[:6]})"
        )


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of a loaded model (for benchmarks via ``LLM.apply_model``),
    plus the engine-held prepacked copies whose plain weights are released: W8A8_DYNAMIC linears
    (``modelslim_engine_linear``) and float routed experts on vLLM-CPU (``engine_experts``)."""
    tensors = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    engine_held = (
        getattr(m, name, None) for m in model.modules() for name in ("modelslim_engine_linear", "engine_experts")
    )
    return tensors + sum(e.nbytes for e in engine_held if e is not None)
