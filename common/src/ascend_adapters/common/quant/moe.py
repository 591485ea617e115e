"""vLLM fused-MoE method for ModelSlim W8A8_DYNAMIC routed experts.

Checkpoint: per expert ``experts.{e}.gate_proj/up_proj/down_proj.weight`` int8 ``[N, K]`` with
``weight_scale`` / ``weight_offset`` ``[N, 1]`` float32. vLLM's RoutedExperts loader stacks them
into ``w13_weight [E, 2I, H]`` / ``w2_weight [E, H, I]`` with per-channel scales
``[E, 2I, 1]`` / ``[E, H, 1]`` (only this rank's experts under expert parallelism).

The forward takes the router's ``topk_ids`` (global ids; negative ids mean "no route") and the
layer's ``expert_map`` (global -> local, -1 for experts on other ranks), and calls the
``modelslim.w8a8_dynamic_moe`` kernel; shared experts are left to vLLM's MoE runner.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import FusedMoeWeightScaleSupported
from vllm.model_executor.utils import set_weight_attrs

from ascend_adapters.common import compat, dispatch
from ascend_adapters.common.kernels.experts import _experts_output_like
from ascend_adapters.common.loading import FLOAT_DTYPES, guard_dtype
from ascend_adapters.common.quant import kernels  # noqa: F401  (registers the ops)
from ascend_adapters.common.quant.description import DescriptionError

# the kernel ops, looked up once
_pack_weight = dispatch.op("modelslim.pack_weight")
_pack_moe_scale = dispatch.op("modelslim.pack_moe_scale")
_w8a8_dynamic_moe = dispatch.op("modelslim.w8a8_dynamic_moe")

_SUPPORTED_ACTIVATIONS = ("silu", "gelu")


def _activation_name(layer_or_moe) -> str:
    act = getattr(layer_or_moe, "activation", "silu")
    return str(getattr(act, "value", act)).lower()


def swiglu_limit(layer, moe=None) -> float | None:
    """The layer's clamped-SwiGLU limit (``swiglu_limit`` of FusedMoE / its config), or None."""
    for owner in (layer, moe):
        limit = getattr(owner, "swiglu_limit", None)
        if limit is not None:
            return float(limit)
    return None


class ModelSlimW8A8DynamicMoEMethod(FusedMoEMethodBase):
    """W8A8_DYNAMIC routed experts (per-channel weight scales, per-token dynamic activation)."""

    def __init__(self, moe: FusedMoEConfig, prefix: str, proj_names: tuple[str, str, str]):
        super().__init__(moe)
        self.prefix = prefix
        self.proj_names = proj_names  # checkpoint names of (gate, up, down), for error messages
        act = _activation_name(moe)
        if act not in _SUPPORTED_ACTIVATIONS:
            raise DescriptionError(
                f"{prefix}: W8A8_DYNAMIC experts with activation {act!r} are not supported "
                f"(supported: {', '.join(_SUPPORTED_ACTIVATIONS)})"
            )
        if getattr(moe, "has_bias", False):
            raise DescriptionError(f"{prefix}: W8A8_DYNAMIC experts with biases are not supported")

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
        layer.modelslim_out_dtype = params_dtype  # the serving dtype: the activations the kernel quantizes
        specs = {
            "w13_weight": ((num_experts, 2 * inter, hidden_size), torch.int8, None),
            "w2_weight": ((num_experts, hidden_size, inter), torch.int8, None),
            "w13_weight_scale": ((num_experts, 2 * inter, 1), torch.float32, "channel"),
            "w2_weight_scale": ((num_experts, hidden_size, 1), torch.float32, "channel"),
            "w13_weight_offset": ((num_experts, 2 * inter, 1), torch.float32, "channel"),
            "w2_weight_offset": ((num_experts, hidden_size, 1), torch.float32, "channel"),
        }
        for name, (shape, dtype, qm) in specs.items():
            init = torch.zeros if "offset" in name else torch.empty
            p = torch.nn.Parameter(init(*shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, p)
            attrs = dict(extra_weight_attrs)
            if qm is not None:
                attrs["quant_method"] = FusedMoeWeightScaleSupported.CHANNEL.value
            set_weight_attrs(p, attrs)
            self._guard(p, name)
        layer.w13_input_scale = None
        layer.w2_input_scale = None

    def _guard(self, param: torch.nn.Parameter, pname: str) -> None:
        allowed = (torch.int8,) if pname.endswith("_weight") else FLOAT_DTYPES
        suffix = pname.split("_", 1)[1]  # weight / weight_scale / weight_offset
        projections = dict(zip(("w1", "w3", "w2"), self.proj_names))
        guard_dtype(
            param,
            allowed,
            lambda shard, expert: f"{self.prefix}.{expert}.{projections.get(shard, shard)}.{suffix}",
            "the ModelSlim description makes these experts W8A8_DYNAMIC",
            lambda t: t.float() if t.is_floating_point() else t,
            error=DescriptionError,
        )

    def process_weights_after_loading(self, layer) -> None:
        for side in ("w13", "w2"):
            off = getattr(layer, f"{side}_weight_offset")
            if torch.count_nonzero(off.data):
                raise DescriptionError(
                    f"{self.prefix}: non-zero {side} weight offsets (asymmetric weights) are "
                    "not supported for W8A8_DYNAMIC experts"
                )
            delattr(layer, f"{side}_weight_offset")
            scale = getattr(layer, f"{side}_weight_scale").data
            if not torch.isfinite(scale).all():
                raise DescriptionError(f"{self.prefix}: non-finite {side} weight scales")
            delattr(layer, f"{side}_weight_scale")
            # in the dtype the kernel takes for the serving dtype, once (a call casts no scale)
            scale = _pack_moe_scale(scale.squeeze(-1).contiguous(), layer.modelslim_out_dtype)
            layer.register_parameter(f"{side}_weight_scale", torch.nn.Parameter(scale, requires_grad=False))
            w = getattr(layer, f"{side}_weight").data
            delattr(layer, f"{side}_weight")
            layer.register_parameter(f"{side}_weight", torch.nn.Parameter(_pack_weight(w), requires_grad=False))

    def get_fused_moe_quant_config(self, layer) -> FusedMoEQuantConfig | None:
        return FusedMoEQuantConfig.make()

    @property
    def is_monolithic(self) -> bool:
        # Engines without a router for these experts (vLLM 0.27/0.28 on CPU) hand us the router logits.
        return compat.moe_method_routes()

    def apply_monolithic(self, layer, x: torch.Tensor, router_logits: torch.Tensor, input_ids=None) -> torch.Tensor:
        topk_weights, topk_ids = compat.moe_select_experts(layer, x, router_logits, input_ids)
        return self.apply(layer, x, topk_weights, topk_ids, None, None)

    def apply(
        self,
        layer,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts,
        shared_experts_input,
    ) -> torch.Tensor:
        return torch.ops.vllm.ascend_adapters_w8a8_dynamic_moe(
            x,
            layer.w13_weight,
            layer.w13_weight_scale,
            layer.w2_weight,
            layer.w2_weight_scale,
            topk_weights,
            topk_ids,
            layer.expert_map,
            _activation_name(layer),
            bool(getattr(layer, "apply_router_weight_on_input", False)),
            swiglu_limit(layer, self.moe),
        )


def _w8a8_dynamic_moe_op(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    activation: str,
    apply_router_weight_on_input: bool,
    swiglu_limit: float | None,
) -> torch.Tensor:
    return _w8a8_dynamic_moe(
        x,
        w13,
        w13_scale,
        w2,
        w2_scale,
        topk_weights,
        topk_ids,
        expert_map=expert_map,
        activation=activation,
        apply_router_weight_on_input=apply_router_weight_on_input,
        swiglu_limit=swiglu_limit,
    )


# torch.ops.vllm.ascend_adapters_w8a8_dynamic_moe: the routed W8A8_DYNAMIC experts as one opaque call for
# vLLM's torch.compile, as common.kernels.experts does for float experts (same why)
compat.register_opaque_op("ascend_adapters_w8a8_dynamic_moe", _w8a8_dynamic_moe_op, fake_impl=_experts_output_like)
