"""torch_npu implementation of the ModelSlim W8A8 kernels.

Calls to the Ascend operators vllm-ascend uses for the same formats:
``npu_dynamic_quant`` / ``npu_quantize``, ``npu_quant_matmul``,
``npu_grouped_matmul`` and ``npu_swiglu`` / ``npu_clipped_swiglu`` (through
common.kernels), and for the MoE's routing ``npu_moe_init_routing_v2`` and
``npu_moe_token_unpermute`` (through common.kernels.experts: fixed shapes, no
host read). Weights are pre-transposed to ``[K, N]`` (``[E, K, N]`` for
experts) once after loading by ``pack_weight``, and the scales are cast once
after loading to the form each operator takes for the layer's activation dtype
(``pack_input_quant``, ``pack_moe_scale``): a call casts no scale.

Each call keeps to the operator's documented contract (Ascend op-plugin,
docs/zh/custom_APIs/torch_npu/*.md); the contracts are checked on CPU by the
emulator in ``ascend_adapters.testing.npu_emulator``, which also runs
these functions against the portable kernels. NOTHING HERE HAS RUN ON AN NPU.

* float16 / bfloat16 activations use the fused operators.
* float32 activations: ``npu_dynamic_quant`` takes float16/bfloat16 only and
  ``npu_quant_matmul`` has no float32 output, so the linears quantize with
  plain torch ops (the portable equations) and take the exact int32
  accumulator from ``npu_quant_matmul(output_dtype=int32)``, scaling in
  float32 themselves; the MoE runs in bfloat16 and casts back (its
  ``npu_grouped_matmul`` has no int32 per-token form).
* ``npu_quant_matmul`` caps the last dimension of its inputs at 65535: wider
  outputs are computed in column blocks, longer reductions in int32 blocks.
"""

from __future__ import annotations

import torch

from ascend_adapters.common import dispatch
from ascend_adapters.common.kernels.activation import swiglu_npu
from ascend_adapters.common.kernels.experts import npu_combine, npu_sort_routes

# npu_quant_matmul.md 约束说明: "x1与x2最后一维的shape大小不能超过65535"
QMM_MAX_LAST_DIM = 65535


@dispatch.npu("modelslim.pack_weight")
def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return weight.transpose(-1, -2).contiguous()


@dispatch.npu("modelslim.pack_input_quant")
def pack_input_quant(
    input_scale: torch.Tensor, input_offset: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """npu_quantize (div_mode False) multiplies by its scales and adds its zero points, both in the
    input's dtype: ``1 / input_scale`` and ``input_offset`` as ``dtype`` ``[1]``."""
    return (1.0 / input_scale.float()).to(dtype).reshape(1), input_offset.to(dtype).reshape(1)


def _moe_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(compute dtype, weight-scale dtype) of the W8A8 experts for ``dtype`` activations.

    npu_grouped_matmul Table 2 (per-token): a bfloat16 scale gives bfloat16, a float32 scale float16;
    there is no float32 output, so float32 activations run in bfloat16 and are cast back."""
    cdt = torch.bfloat16 if dtype == torch.float32 else dtype
    return cdt, (torch.bfloat16 if cdt == torch.bfloat16 else torch.float32)


@dispatch.npu("modelslim.pack_moe_scale")
def pack_moe_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An expert projection's ``[E, N]`` weight scales in the dtype npu_grouped_matmul takes for ``dtype``
    activations (``_moe_dtypes``)."""
    return scale.to(_moe_dtypes(dtype)[1]).contiguous()


def _blocks(n: int, size: int = QMM_MAX_LAST_DIM) -> list[slice]:
    return [slice(a, min(a + size, n)) for a in range(0, n, size)]


def _int32_matmul(xq: torch.Tensor, w_kn: torch.Tensor) -> torch.Tensor:
    """Exact ``xq [M, K] @ w [K, N]`` as int32, in blocks of at most 65535 along K and N."""
    import torch_npu

    M, K = xq.shape
    N = w_kn.shape[-1]
    acc = torch.zeros(M, N, dtype=torch.int32, device=xq.device)
    # Table 2 row "int8 int8 float32/bfloat16 None int32/None None int32": a unit scale, so the result is
    # the accumulator whether or not the operator applies the scale to an int32 output. Made once per
    # call, each block takes its slice.
    ones = torch.ones(min(N, QMM_MAX_LAST_DIM), dtype=torch.float32, device=xq.device)
    for kb in _blocks(K):
        for nb in _blocks(N):
            acc[:, nb] += torch_npu.npu_quant_matmul(
                xq[:, kb].contiguous(), w_kn[kb, nb].contiguous(), ones[: nb.stop - nb.start], output_dtype=torch.int32
            )
    return acc


@dispatch.npu("modelslim.w8a8_dynamic_linear")
def w8a8_dynamic_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    import torch_npu

    shape = x.shape
    K, N = weight.shape
    x2 = x.reshape(-1, shape[-1])
    scale = weight_scale.reshape(-1).float()
    if x.dtype == torch.float32 or K > QMM_MAX_LAST_DIM:
        from ascend_adapters.common.quant.kernels.portable import quantize_per_token

        xq, s = quantize_per_token(x2)
        y = _int32_matmul(xq, weight).to(torch.float32) * (s * scale.reshape(1, -1))
        y = y.to(x.dtype)
    else:
        # npu_dynamic_quant: x float16/bfloat16 -> int8 and float32 scale of shape x.shape[:-1]
        xq, s = torch_npu.npu_dynamic_quant(x2)
        # npu_quant_matmul Table 2: scale float32 + pertoken float32 -> float16 or bfloat16 output
        y = torch.cat(
            [
                torch_npu.npu_quant_matmul(
                    xq, weight[:, nb], scale[nb], pertoken_scale=s.reshape(-1), output_dtype=x.dtype
                )
                for nb in _blocks(N)
            ],
            dim=-1,
        )
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*shape[:-1], N)


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
    K, N = weight.shape
    x2 = x.reshape(-1, shape[-1])
    # npu_quantize (div_mode False): scales and zero_points in the input's dtype, as pack_input_quant
    # made them at load (input_scale is 1 / the checkpoint's scale)
    xq = torch_npu.npu_quantize(x2, input_scale, input_offset, torch.qint8, -1, False)
    deq = deq_scale.reshape(-1).float()
    if x.dtype == torch.float32 or K > QMM_MAX_LAST_DIM:
        acc = _int32_matmul(xq, weight)
        if quant_bias is not None:
            acc = acc + quant_bias.to(torch.int32).reshape(1, -1)
        y = (acc.to(torch.float32) * deq.reshape(1, -1)).to(x.dtype)
    else:
        # npu_quant_matmul Table 2: scale float32, bias int32/None, no pertoken -> float16 (row 1) or
        # bfloat16 (row 3). A float32 scale avoids the int64 encoding of npu_trans_quant_param.
        qb = None if quant_bias is None else quant_bias.to(torch.int32).reshape(-1)
        y = torch.cat(
            [
                torch_npu.npu_quant_matmul(
                    xq, weight[:, nb], deq[nb], bias=None if qb is None else qb[nb], output_dtype=x.dtype
                )
                for nb in _blocks(N)
            ],
            dim=-1,
        )
    return y.reshape(*shape[:-1], N)


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
    """``w13 [E, H, 2I]`` / ``w2 [E, I, H]`` int8 (packed by ``pack_weight``), scales ``[E, 2I]`` / ``[E, H]``
    (cast by ``pack_moe_scale`` for x's dtype).

    Fixed shapes, no host read (``common.kernels.experts``, NPU twin): ``npu_moe_init_routing_v2`` sorts
    all T*k routes, ``npu_dynamic_quant`` quantizes the sorted rows (routing unquantized, then quantizing,
    keeps ``apply_router_weight_on_input`` for any k: the weight scales each route's row before its
    quantization), one ``npu_grouped_matmul`` per projection, ``npu_moe_token_unpermute`` in float32
    combines (the routes of no local expert weighted 0)."""
    import torch_npu

    if activation != "silu":
        raise ValueError(f"W8A8_DYNAMIC MoE on NPU: activation {activation!r} is not supported (silu)")
    T, H = x.shape
    E = w13.shape[0]
    if w13.shape[1] != H or w2.shape[2] != H:
        raise ValueError(f"W8A8_DYNAMIC MoE on NPU: packed w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} for H={H}")
    if T == 0:
        return torch.zeros_like(x)
    cdt = _moe_dtypes(x.dtype)[0]  # the scales are already in the dtype it takes (pack_moe_scale)
    k = topk_ids.shape[-1]
    wts = topk_weights.reshape(T, k).float()
    routes = npu_sort_routes(torch_npu, x.to(cdt), topk_ids, E, expert_map)
    rows = routes.rows
    if apply_router_weight_on_input:
        # each sorted row's router weight: row_idx is a permutation of the T*k rows (the gather index)
        w_rows = torch.empty(T * k, dtype=torch.float32, device=x.device)
        w_rows.scatter_(0, routes.row_idx.long(), wts.reshape(-1))
        rows = (rows.float() * w_rows[:, None]).to(cdt)

    def gmm(a, a_scale, w, w_scale):
        return torch_npu.npu_grouped_matmul(
            x=[a],
            weight=[w],
            scale=[w_scale],
            per_token_scale=[a_scale],
            split_item=2,
            group_list_type=0,
            group_type=0,
            group_list=routes.group_list,
            output_dtype=cdt,
        )[0]

    xq, s = torch_npu.npu_dynamic_quant(rows)
    h = gmm(xq, s, w13, w13_scale)
    h = swiglu_npu(h, swiglu_limit)  # npu_swiglu, or npu_clipped_swiglu with the limit
    hq, hs = torch_npu.npu_dynamic_quant(h)
    o = gmm(hq, hs, w2, w2_scale).float()
    probs = torch.ones_like(wts) if apply_router_weight_on_input else wts
    return npu_combine(torch_npu, o, routes, probs).to(x.dtype)
