"""torch_npu implementation of the ModelSlim W8A8 kernels.

Thin calls to the Ascend operators vllm-ascend uses for the same formats:
``npu_dynamic_quant`` / ``npu_quantize``, ``npu_quant_matmul``,
``npu_grouped_matmul`` and ``npu_swiglu``. Weights are pre-transposed to
``[K, N]`` (``[E, K, N]`` for experts) once after loading by ``pack_weight``.

NOT TESTED: no NPU was available while this was written. The portable
implementation (kernels/portable.py) is the tested reference for the math;
``ASCEND_ADAPTERS_FORCE_PORTABLE=1`` selects it on an NPU machine too.
"""

from __future__ import annotations

import torch

from ascend_adapters.common import dispatch


@dispatch.npu("modelslim.pack_weight")
def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return weight.transpose(-1, -2).contiguous()


@dispatch.npu("modelslim.w8a8_dynamic_linear")
def w8a8_dynamic_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    import torch_npu

    shape = x.shape
    xq, s = torch_npu.npu_dynamic_quant(x.reshape(-1, shape[-1]))
    y = torch_npu.npu_quant_matmul(
        xq, weight, weight_scale.reshape(-1), pertoken_scale=s.reshape(-1), bias=None, output_dtype=x.dtype
    )
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*shape[:-1], weight.shape[-1])


@dispatch.npu("modelslim.w8a8_static_linear")
def w8a8_static_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    input_offset: torch.Tensor,
    deq_scale: torch.Tensor,
    quant_bias: torch.Tensor | None,
) -> torch.Tensor:
    import torch_npu

    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    inv = (1.0 / input_scale.float()).to(x.dtype).reshape(1)
    off = input_offset.to(x.dtype).reshape(1)
    xq = torch_npu.npu_quantize(x2, inv, off, torch.qint8, -1, False)
    if x.dtype == torch.bfloat16:
        deq = deq_scale.float()
    else:  # float16 output takes the float32 bit pattern as int64 (as in the checkpoint)
        deq = deq_scale.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    y = torch_npu.npu_quant_matmul(xq, weight, deq, bias=quant_bias, output_dtype=x.dtype)
    return y.reshape(*shape[:-1], weight.shape[-1])


@dispatch.npu("modelslim.w8a8_dynamic_moe")
def w8a8_dynamic_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    import torch_npu

    from ascend_adapters.common.quant.kernels.portable import local_routes

    if activation != "silu":
        raise ValueError(f"W8A8_DYNAMIC MoE on NPU: activation {activation!r} is not supported (silu)")
    T, H = x.shape
    E, k = w13.shape[0], topk_ids.shape[-1]
    local = local_routes(topk_ids.reshape(T, k), E, expert_map).reshape(-1)
    tok = torch.arange(T, device=x.device).repeat_interleave(k)
    wts = topk_weights.reshape(-1).float()
    keep = local >= 0
    local, tok, wts = local[keep], tok[keep], wts[keep]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    if local.numel() == 0:
        return out.to(x.dtype)
    order = torch.argsort(local, stable=True)
    local, tok, wts = local[order], tok[order], wts[order]
    group_list = torch.bincount(local, minlength=E).to(torch.int64)
    rows = x[tok]
    if apply_router_weight_on_input:
        rows = (rows.float() * wts[:, None]).to(x.dtype)
    xq, s = torch_npu.npu_dynamic_quant(rows)
    h = torch_npu.npu_grouped_matmul(
        x=[xq],
        weight=[w13],
        scale=[w13_scale.float()],
        per_token_scale=[s],
        split_item=2,
        group_list_type=1,
        group_type=0,
        group_list=group_list,
        output_dtype=x.dtype,
    )[0]
    if swiglu_limit is not None and swiglu_limit > 0:
        gate, up = h.chunk(2, dim=-1)  # clamped SwiGLU: no fused NPU op, plain torch between the matmuls
        h = (torch.nn.functional.silu(gate.clamp(max=swiglu_limit)) * up.clamp(-swiglu_limit, swiglu_limit)).to(h.dtype)
    else:
        h = torch_npu.npu_swiglu(h)
    hq, hs = torch_npu.npu_dynamic_quant(h)
    o = torch_npu.npu_grouped_matmul(
        x=[hq],
        weight=[w2],
        scale=[w2_scale.float()],
        per_token_scale=[hs],
        split_item=2,
        group_list_type=1,
        group_type=0,
        group_list=group_list,
        output_dtype=x.dtype,
    )[0].float()
    if not apply_router_weight_on_input:
        o = o * wts[:, None]
    out.index_add_(0, tok, o)
    return out.to(x.dtype)
