"""DeepSeek-V4's MoE block on vLLM's fused-MoE layer.

The routed experts are one ``FusedMoEFactory`` layer: vLLM owns the stacked weights, their loader
(per-expert checkpoint tensors, tensor-parallel intermediate shards, expert-parallel placement
through ``expert_map``) and the quantization hook, so a ModelSlim W8A8_DYNAMIC export gets common's
``ModelSlimW8A8DynamicMoEMethod`` and a platform plugin can substitute its own method.

Two pieces are this model's own:

* routing (``DeepseekV4Router``): sqrtsoftplus scores with the score-correction bias, or the
  hash table ``tid2eid[input_id]`` in the first layers, through the portable ``dsv4.route`` op.
  vLLM's CPU routers cannot serve it (0.32's ``biased_topk_cpu`` rejects 8 experts; 0.27's CPU
  path asserts softmax scoring), measured here;
* the float experts (``DeepseekV4FloatMoEMethod``): vLLM's CPU unquantized kernel ignores
  ``swiglu_limit`` (measured on 0.32: its output equals the unclamped SwiGLU), so float experts run
  common's clamped-SwiGLU experts kernel, which honours ``expert_map`` for expert parallelism.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.fused_moe import FusedMoEFactory, GateLinear, RoutedExperts
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig, RoutingMethodType
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLP
from vllm.model_executor.utils import set_weight_attrs

from ascend_adapters.common import dispatch
from ascend_adapters.common import kernels as _common_kernels  # noqa: F401  (registers the shared ops)
from ascend_adapters.common.kernels import experts
from ascend_adapters.common.loading import FLOAT_DTYPES, guard_dtype
from ascend_adapters.deepseek_v4 import kernels as _kernels  # noqa: F401  (registers dsv4.route)

# the kernel ops, looked up once
_route = dispatch.op("dsv4.route")
_swiglu = dispatch.op("common.swiglu")


class DeepseekV4Router(FusedMoERouter):
    """Top-k over sqrtsoftplus(+bias) scores, or hash routing by token id; weights renormalised and scaled."""

    def __init__(self, moe: DeepseekV4MoE):
        super().__init__()
        self._moe = [moe]  # a list: the router is no nn.Module and must not own the block
        self.capture_fn = None

    def set_capture_fn(self, capture_fn) -> None:
        self.capture_fn = capture_fn

    @property
    def routing_method_type(self) -> RoutingMethodType:
        return RoutingMethodType.DeepseekV4

    def _select_experts(self, hidden_states, router_logits, topk_indices_dtype=None, *, input_ids=None):
        moe = self._moe[0]
        kw = {}
        if moe.is_hash:
            if input_ids is None:
                raise ValueError("hash-routed MoE layers need token ids (inputs_embeds alone is not supported)")
            kw["hash_ids"] = moe.gate.tid2eid[input_ids.long()]
        else:
            kw["bias"] = moe.gate.e_score_correction_bias
        w, ids = _route(
            router_logits, top_k=moe.top_k, scoring=moe.scoring, scaling=moe.scaling, normalize=moe.normalize, **kw
        )
        if self.capture_fn is not None:
            self.capture_fn(ids)
        return w.float(), ids.to(topk_indices_dtype or torch.int32)


class DeepseekV4FloatMoEMethod(FusedMoEMethodBase):
    """Float routed experts with the clamped SwiGLU, through common's ``common.swiglu_experts`` op."""

    def create_weights(
        self,
        layer,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        inter = intermediate_size_per_partition
        for name, shape in (
            ("w13_weight", (num_experts, 2 * inter, hidden_size)),
            ("w2_weight", (num_experts, hidden_size, inter)),
        ):
            p = nn.Parameter(torch.empty(shape, dtype=params_dtype), requires_grad=False)
            layer.register_parameter(name, p)
            set_weight_attrs(p, extra_weight_attrs)
            guard_dtype(
                p,
                FLOAT_DTYPES,
                lambda shard, expert, _name=name: f"{_name} (expert {expert}, shard {shard})",
                "no ModelSlim description makes these routed experts quantized",
            )

    def process_weights_after_loading(self, layer) -> None:
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        choice = dispatch.choose(
            "common.swiglu_experts",
            [(experts.ENGINE_EXPERTS, lambda: experts.engine_swiglu_experts(w13, w2))],
            switch=experts.PORTABLE_EXPERTS_ENV,
        )
        layer.experts_source = choice.source  # which implementation serves, and why (dispatch.choose)
        layer.engine_experts = choice.fn if choice.source == experts.ENGINE_EXPERTS else None
        if layer.engine_experts is not None:
            # the engine holds its prepacked copy: release the stacked weights, as vLLM's CPU linears do
            for name in ("w13_weight", "w2_weight"):
                delattr(layer, name)
                layer.register_parameter(name, None)

    def get_fused_moe_quant_config(self, layer) -> FusedMoEQuantConfig | None:
        return FusedMoEQuantConfig.make()

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        from ascend_adapters.common.quant.moe import swiglu_limit

        expert_map, limit = getattr(layer, "expert_map", None), swiglu_limit(layer, self.moe)
        if layer.engine_experts is not None:
            return layer.engine_experts(x, topk_weights, topk_ids, expert_map, limit)
        return torch.ops.vllm.ascend_adapters_swiglu_experts(
            x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, expert_map, limit
        )


class DeepseekV4RoutedExperts(RoutedExperts):
    """vLLM's routed experts, with the clamped-SwiGLU float method where vLLM would pick its own."""

    def _get_quant_method(self, prefix, quant_config, moe_config):
        method = super()._get_quant_method(prefix, quant_config, moe_config)
        if isinstance(method, UnquantizedFusedMoEMethod):
            return DeepseekV4FloatMoEMethod(moe_config)
        return method


class ClampedSwiGLU(nn.Module):
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` on ``[gate | up]``.

    vLLM's ``SiluAndMulWithClamp`` computes ``gate * sigmoid(gate)``, which rounds differently from
    transformers' ``silu(gate)`` (in bfloat16 by one more rounding); this keeps transformers' order.
    """

    def __init__(self, limit: float | None):
        super().__init__()
        self.limit = limit

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return _swiglu(gate_up, self.limit)


class DeepseekV4SharedExpert(DeepseekV2MLP):
    """vLLM's DeepSeek MLP (fused gate/up, TP-sharded) with DeepSeek-V4's clamped SwiGLU."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float | None, quant_config, prefix: str):
        super().__init__(hidden_size, intermediate_size, "silu", quant_config=quant_config, prefix=prefix)
        self.act_fn = ClampedSwiGLU(limit)


class DeepseekV4MoE(nn.Module):
    """Router gate (float32 logits), routed experts on FusedMoE, and the shared expert (TP-sharded)."""

    def __init__(self, config, layer_idx: int, quant_config=None, prefix: str = ""):
        super().__init__()
        self.prefix = prefix
        self.is_hash = config.mlp_layer_types[layer_idx] == "hash_moe"
        self.top_k = config.num_experts_per_tok
        self.n_experts = config.n_routed_experts
        self.scoring = config.scoring_func
        self.scaling = config.routed_scaling_factor
        self.normalize = bool(getattr(config, "norm_topk_prob", True))
        self.limit = config.swiglu_limit
        h, inter = config.hidden_size, config.moe_intermediate_size
        # float32 weight and logits, as DeepSeek's reference scores experts
        self.gate = GateLinear(
            h, self.n_experts, bias=False, out_dtype=torch.float32, force_fp32_compute=True, prefix=f"{prefix}.gate"
        )
        if self.is_hash:
            self.gate.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(self.n_experts), requires_grad=False)
        router = DeepseekV4Router(self)
        self.experts = FusedMoEFactory(
            num_experts=self.n_experts,
            top_k=self.top_k,
            hidden_size=h,
            intermediate_size=inter,
            renormalize=self.normalize,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
            router=router,
            swiglu_limit=self.limit,
            reduce_results=True,
            routed_experts_cls=DeepseekV4RoutedExperts,
        )
        # a monolithic quant method on an engine without a CPU router routes with it (compat.moe_select_experts)
        self.experts.routed_experts.model_router = router
        self.shared_experts = DeepseekV4SharedExpert(
            h, inter * max(1, config.n_shared_experts), self.limit, quant_config, f"{prefix}.shared_experts"
        )

    @property
    def routed(self) -> RoutedExperts:
        return self.experts.routed_experts

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor:
        logits, _ = self.gate(x)
        routed = self.experts(hidden_states=x, router_logits=logits, input_ids=input_ids)
        if isinstance(routed, tuple):  # (shared, routed) when a runner owns shared experts; ours does not
            routed = routed[-1]
        return routed + self.shared_experts(x)
