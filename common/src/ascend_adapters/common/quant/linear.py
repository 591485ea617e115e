"""vLLM linear methods for ModelSlim W8A8 (static), W8A8_DYNAMIC and FLOAT layers.

Parameters use vLLM's parameter classes, so fused modules (q/k/v, gate/up) and
tensor parallelism load through vLLM's own weight loaders. Every checkpoint
tensor passes a check first (dtype against the description's type; the error
names the tensor), and ``deq_scale`` is kept as the int64 float32 bit pattern
until loading ends (a float32 ``deq_scale`` is converted to its bits, so both
encodings load into the same parameter).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    RowParallelLinear,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.parameter import (
    ChannelQuantScaleParameter,
    ModelWeightParameter,
    PerTensorScaleParameter,
)

from ascend_adapters.common import compat, dispatch
from ascend_adapters.common.loading import FLOAT_DTYPES, guard_dtype
from ascend_adapters.common.platform import KernelPath, path_for_device
from ascend_adapters.common.quant import kernels  # noqa: F401  (registers the ops)
from ascend_adapters.common.quant.description import W8A8, W8A8_DYNAMIC, DescriptionError
from ascend_adapters.common.quant.kernels import portable

# the kernel ops, looked up once
_pack_weight = dispatch.op("modelslim.pack_weight")
_pack_input_quant = dispatch.op("modelslim.pack_input_quant")
_w8a8_dynamic_linear = dispatch.op("modelslim.w8a8_dynamic_linear")
_w8a8_static_linear = dispatch.op("modelslim.w8a8_static_linear")

logger = logging.getLogger("ascend_adapters")

# dispatch.choose labels of the CPU W8A8_DYNAMIC linears (portable.cpu_layout): vLLM-CPU's prepacked oneDNN
# int8 GEMM, or the plain int8 weight through torch's int8pack kernel
CPU_PATHS = (portable.EngineInt8Linear.path, portable.PackedInt8Linear.path)


def decode_deq_scale(deq: torch.Tensor) -> torch.Tensor:
    """deq_scale as float32: int64 values carry the float32 bit pattern in their low 32 bits."""
    if deq.dtype == torch.float32:
        return deq
    if deq.is_floating_point():
        return deq.float()
    bits = deq.to(torch.int64) & 0xFFFFFFFF
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(torch.int32).view(torch.float32)


def encode_deq_scale(deq: torch.Tensor) -> torch.Tensor:
    """float deq_scale -> int64 holding its float32 bits (the ModelSlim encoding)."""
    return deq.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def guard_param(
    param: torch.nn.Parameter,
    name: str,
    kind: str,
    allowed: tuple[torch.dtype, ...],
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.nn.Parameter:
    """common's dtype-guarded loader for a linear's tensor that the description makes ``kind``."""
    return guard_dtype(
        param,
        allowed,
        lambda shard, _expert: name if shard is None else f"{name} (shard {shard!r})",
        f"the ModelSlim description makes this layer {kind}",
        convert,
        error=DescriptionError,
    )


def _int8_weight(layer, name, input_size_per_partition, output_partition_sizes, weight_loader, kind):
    w = ModelWeightParameter(
        data=torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=torch.int8),
        input_dim=1,
        output_dim=0,
        weight_loader=weight_loader,
    )
    guard_param(w, f"{name}.weight", kind, (torch.int8,))
    layer.register_parameter("weight", w)


def _channel(layer, attr, name, n, dtype, weight_loader, kind, allowed, convert=None, shape_tail=(1,)):
    p = ChannelQuantScaleParameter(
        data=torch.empty(n, *shape_tail, dtype=dtype), output_dim=0, weight_loader=weight_loader
    )
    guard_param(p, f"{name}.{attr}", kind, allowed, convert)
    layer.register_parameter(attr, p)


def _per_tensor(layer, attr, name, n_shards, weight_loader, kind, allowed):
    p = PerTensorScaleParameter(
        data=torch.full((n_shards,), float("nan"), dtype=torch.float32), weight_loader=weight_loader
    )
    guard_param(p, f"{name}.{attr}", kind, allowed, lambda t: t.float().reshape(-1)[:1].reshape(t.shape))
    layer.register_parameter(attr, p)


def _replace(layer, attr, data: torch.Tensor) -> None:
    delattr(layer, attr)
    layer.register_parameter(attr, torch.nn.Parameter(data, requires_grad=False))


@register_weight_loader_v2_supported_method
class ModelSlimW8A8DynamicLinearMethod(LinearMethodBase):
    """W8A8_DYNAMIC: int8 weight [N, K] with per-channel weight_scale [N, 1]; per-token int8 activations."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def create_weights(
        self,
        layer,
        input_size_per_partition,
        output_partition_sizes,
        input_size,
        output_size,
        params_dtype,
        **extra_weight_attrs,
    ):
        loader = extra_weight_attrs["weight_loader"]
        n = sum(output_partition_sizes)
        layer.modelslim_out_dtype = params_dtype  # the serving dtype: what the engine GEMM writes
        _int8_weight(layer, self.prefix, input_size_per_partition, output_partition_sizes, loader, W8A8_DYNAMIC)
        _channel(
            layer,
            "weight_scale",
            self.prefix,
            n,
            torch.float32,
            loader,
            W8A8_DYNAMIC,
            FLOAT_DTYPES,
            lambda t: t.float(),
        )
        # weight_offset is zeros in symmetric exports; loaded to verify, then dropped.
        p = ChannelQuantScaleParameter(data=torch.zeros(n, 1, dtype=torch.float32), output_dim=0, weight_loader=loader)
        guard_param(p, f"{self.prefix}.weight_offset", W8A8_DYNAMIC, FLOAT_DTYPES, lambda t: t.float())
        layer.register_parameter("weight_offset", p)

    def process_weights_after_loading(self, layer) -> None:
        if torch.count_nonzero(layer.weight_offset.data):
            raise DescriptionError(
                f"{self.prefix}.weight_offset: non-zero weight offsets (asymmetric weights) are "
                "not supported for W8A8_DYNAMIC"
            )
        delattr(layer, "weight_offset")
        scale = layer.weight_scale.data.reshape(-1).float()
        if not torch.isfinite(scale).all():
            raise DescriptionError(f"{self.prefix}.weight_scale: contains non-finite values")
        _replace(layer, "weight_scale", scale.contiguous())
        weight = _pack_weight(layer.weight.data)

        out_dtype = layer.modelslim_out_dtype
        on_cpu = weight.device.type == "cpu" and path_for_device("cpu") is KernelPath.PORTABLE
        cpu_path = portable.cpu_layout(out_dtype)["path"] if on_cpu else "cpu"

        def cpu_linear():
            if not on_cpu:
                return "the NPU path"
            linear = portable.cpu_dynamic_linear(weight, layer.weight_scale, out_dtype)
            return linear if linear is not None else f"{out_dtype} takes the torch path on this CPU"

        choice = dispatch.choose("modelslim.w8a8_dynamic_linear", [(cpu_path, cpu_linear)])
        if choice.source in CPU_PATHS:
            # the linear keeps the weight in its own layout (the engine's prepacked copy, or the plain
            # int8 tensor for torch's kernel): release the layer's parameter, as vLLM's CPU W8A8 kernel does
            layer.modelslim_engine_linear = choice.fn
            delattr(layer, "weight")
            layer.register_parameter("weight", None)
        else:
            layer.modelslim_engine_linear = None
            _replace(layer, "weight", weight)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.modelslim_engine_linear is not None:
            return layer.modelslim_engine_linear(x, bias)
        return _w8a8_dynamic_linear(x, layer.weight, layer.weight_scale, bias)


@register_weight_loader_v2_supported_method
class ModelSlimW8A8StaticLinearMethod(LinearMethodBase):
    """W8A8 static: per-tensor asymmetric activation (input_scale/input_offset), int32 quant_bias, deq_scale.

    The float ``bias`` of such a layer is already folded into ``quant_bias`` and is not added again.
    In a row-parallel layer only tensor-parallel rank 0 adds ``quant_bias``.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix

    def create_weights(
        self,
        layer,
        input_size_per_partition,
        output_partition_sizes,
        input_size,
        output_size,
        params_dtype,
        **extra_weight_attrs,
    ):
        loader = extra_weight_attrs["weight_loader"]
        n = sum(output_partition_sizes)
        shards = len(output_partition_sizes)
        layer.modelslim_out_dtype = params_dtype  # the serving dtype: the activations the kernel quantizes
        _int8_weight(layer, self.prefix, input_size_per_partition, output_partition_sizes, loader, W8A8)
        _channel(
            layer,
            "deq_scale",
            self.prefix,
            n,
            torch.int64,
            loader,
            W8A8,
            (torch.int64, torch.float32),
            lambda t: t if t.dtype == torch.int64 else encode_deq_scale(t),
            shape_tail=(),
        )
        _channel(layer, "quant_bias", self.prefix, n, torch.int32, loader, W8A8, (torch.int32,), shape_tail=())
        _per_tensor(layer, "input_scale", self.prefix, shards, loader, W8A8, FLOAT_DTYPES)
        _per_tensor(
            layer,
            "input_offset",
            self.prefix,
            shards,
            loader,
            W8A8,
            (*FLOAT_DTYPES, torch.int8, torch.int32, torch.int64),
        )

    def process_weights_after_loading(self, layer) -> None:
        scales, offsets = layer.input_scale.data.float(), layer.input_offset.data.float()
        for attr, vals in (("input_scale", scales), ("input_offset", offsets)):
            if torch.isnan(vals).any():
                raise DescriptionError(
                    f"{self.prefix}.{attr}: not loaded for every fused shard "
                    f"(got {vals.tolist()}); W8A8 needs it for each shard"
                )
            if (vals != vals[0]).any():
                raise DescriptionError(
                    f"{self.prefix}.{attr}: the fused shards have different values "
                    f"{vals.tolist()}; one fused module quantizes its input once"
                )
        if not scales[0] > 0:
            raise DescriptionError(f"{self.prefix}.input_scale: must be positive, got {float(scales[0])}")
        if offsets[0] != torch.round(offsets[0]):
            raise DescriptionError(f"{self.prefix}.input_offset: must hold an integer value, got {float(offsets[0])}")
        deq = decode_deq_scale(layer.deq_scale.data)
        if not torch.isfinite(deq).all():
            raise DescriptionError(f"{self.prefix}.deq_scale: decodes to non-finite values")
        # in the form the kernel takes for the serving dtype, once (the NPU's npu_quantize: 1 / scale and
        # the offset in the activations' dtype), so a call casts nothing
        scale, offset = _pack_input_quant(scales[:1].clone(), offsets[:1].clone(), layer.modelslim_out_dtype)
        _replace(layer, "input_scale", scale)
        _replace(layer, "input_offset", offset)
        _replace(layer, "deq_scale", deq.contiguous())
        adds_bias = not (isinstance(layer, RowParallelLinear) and getattr(layer, "tp_rank", 0) > 0)
        layer.modelslim_adds_quant_bias = adds_bias
        _replace(layer, "weight", _pack_weight(layer.weight.data))

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # ``bias`` (the float bias) is folded into quant_bias by the exporter: never added here.
        qb = layer.quant_bias if layer.modelslim_adds_quant_bias else None
        return torch.ops.vllm.ascend_adapters_w8a8_static_linear(
            x, layer.weight, layer.input_scale, layer.input_offset, layer.deq_scale, qb
        )


@register_weight_loader_v2_supported_method
class ModelSlimFloatLinearMethod(UnquantizedLinearMethod):
    """FLOAT layer of a ModelSlim export: vLLM's unquantized method plus a dtype check naming the tensor."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def create_weights(
        self,
        layer,
        input_size_per_partition,
        output_partition_sizes,
        input_size,
        output_size,
        params_dtype,
        **extra_weight_attrs,
    ):
        super().create_weights(
            layer,
            input_size_per_partition,
            output_partition_sizes,
            input_size,
            output_size,
            params_dtype,
            **extra_weight_attrs,
        )
        guard_param(layer.weight, f"{self.prefix}.weight", "FLOAT", FLOAT_DTYPES)


LINEAR_METHODS = {
    W8A8_DYNAMIC: ModelSlimW8A8DynamicLinearMethod,
    W8A8: ModelSlimW8A8StaticLinearMethod,
}


def _w8a8_static_linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    input_offset: torch.Tensor,
    deq_scale: torch.Tensor,
    quant_bias: torch.Tensor | None,
) -> torch.Tensor:
    return _w8a8_static_linear(x, weight, input_scale, input_offset, deq_scale, quant_bias)


def _w8a8_static_linear_shape(x, weight, input_scale, input_offset, deq_scale, quant_bias) -> torch.Tensor:
    # the output width from deq_scale [N]: the weight is [N, K] on the portable path and packed [K, N] on the NPU's
    return x.new_empty(*x.shape[:-1], deq_scale.shape[0])


# torch.ops.vllm.ascend_adapters_w8a8_static_linear: the static W8A8 linear as one opaque call for vLLM's
# torch.compile. Traced by inductor, it came out different from the eager kernel (a served GLM-DSA W8A8 export
# drifted from its reference by ~4 in the logits; which of the per-tensor quantization and the int32 GEMM differs
# was not isolated); kept opaque, the compiled model runs the eager kernel. The dynamic linear's CPU linears
# (EngineInt8Linear, PackedInt8Linear) trace exactly and are not wrapped.
compat.register_opaque_op(
    "ascend_adapters_w8a8_static_linear", _w8a8_static_linear_op, fake_impl=_w8a8_static_linear_shape
)
