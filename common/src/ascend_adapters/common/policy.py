"""Start-up policy: the one way an adapter hooks vLLM's per-architecture config checks.

While vLLM builds its config (in the API or ``LLM`` process, before any engine
process starts) it calls ``MODELS_CONFIG_MAP[architecture]``'s
``verify_and_update_model_config(model_config)`` and then
``verify_and_update_config(vllm_config)``. ``install_policy`` maps each of an
adapter's architectures to a subclass of the class vLLM already maps there
(plus ``base``, e.g. ``MambaModelConfig`` for a model that keeps its state in
vLLM's state cache). Each hook runs the parents' versions first (the mapped
class, then ``base``), so vLLM's own updates are kept, then the adapter's check, which therefore sees the config the
engine will really run with and refuses what the adapter cannot serve.

Installing is idempotent (vLLM calls plugins in every process): an
architecture whose mapped class already carries this check, directly or through
a subclass someone else installed over it, is left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

_MARKER = "_ascend_adapters_policy"


def _key(check: Callable) -> str:
    return f"{check.__module__}.{check.__qualname__}"


def _parents(current: type | None, base: type | None) -> tuple[type, ...]:
    from vllm.model_executor.models.config import VerifyAndUpdateConfig

    found = [c for c in (current, base) if c is not None]
    if len(found) == 2:
        a, b = found
        if issubclass(a, b):
            found = [a]
        elif issubclass(b, a):
            found = [b]
    return tuple(found) or (VerifyAndUpdateConfig,)


REFUSAL_PREFIX = "ascend-adapters REFUSED the start-up:"


def refusal_line(exc: BaseException) -> str:
    """One line for a start-up refusal: the exception's message with its lines joined."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip()) or type(exc).__name__
    return f"{REFUSAL_PREFIX} {text}"


def _refusing(check: Callable, config) -> None:
    """Run an adapter's check; a refusal is written to stderr in one line before it propagates, because vLLM
    reports it at the bottom of its own traceback (about 18 frames in ``vllm serve``)."""
    import sys

    try:
        check(config)
    except Exception as exc:
        sys.stderr.write(refusal_line(exc) + "\n")
        sys.stderr.flush()
        raise


def policy_class(
    current: type | None,
    check: Callable,
    *,
    check_model: Callable | None = None,
    base: type | None = None,
    name: str = "StartupPolicy",
    before_parents: bool = False,
) -> type:
    """The class ``install_policy`` maps: ``current`` (and ``base``) first, then the adapter's checks."""
    key = _key(check)
    parents = _parents(current, base)

    # vLLM's classes do not call super(), so each parent's hook is called explicitly, in order.
    class Policy(*parents):
        @classmethod
        def verify_and_update_model_config(cls, model_config) -> None:
            for parent in parents:
                parent.verify_and_update_model_config(model_config)
            if check_model is not None:
                _refusing(check_model, model_config)

        @classmethod
        def verify_and_update_config(cls, vllm_config) -> None:
            if before_parents:
                _refusing(check, vllm_config)
            for parent in parents:
                parent.verify_and_update_config(vllm_config)
            if not before_parents:
                _refusing(check, vllm_config)

    setattr(Policy, _MARKER, key)
    Policy.__name__ = Policy.__qualname__ = name
    return Policy


def install_policy(
    architectures: Iterable[str],
    check: Callable,
    *,
    check_model: Callable | None = None,
    base: type | None = None,
    name: str = "StartupPolicy",
    before_parents: bool = False,
) -> list[str]:
    """Hook ``check(vllm_config)`` (and ``check_model(model_config)``) into vLLM's config checks.

    ``check`` raises, with the reason and the fix, on what the adapter cannot serve.
    ``before_parents``: run ``check`` before the parents' hooks instead of after, for an
    adapter that must set a cache option the parents then size from.
    Returns the architectures installed by this call.
    """
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    key = _key(check)
    done = []
    for arch in architectures:
        current = MODELS_CONFIG_MAP.get(arch)
        if getattr(current, _MARKER, None) == key:
            continue
        MODELS_CONFIG_MAP[arch] = policy_class(
            current, check, check_model=check_model, base=base, name=name, before_parents=before_parents
        )
        done.append(arch)
    return done


# the cache-dtype flags of vLLM's CacheConfig (the same names in 0.27.1, 0.28.0 and 0.32.0): the attention
# cache's, and the recurrent state's (mamba_ssm falls back to mamba_cache_dtype under 'auto')
CACHE_DTYPE_FLAGS = {
    "cache_dtype": "--kv-cache-dtype",
    "mamba_cache_dtype": "--mamba-cache-dtype",
    "mamba_ssm_cache_dtype": "--mamba-ssm-cache-dtype",
}


# the --kv-cache-dtype values served as the 8-bit cache (``kernels.kv8``): float8 e4m3 (vLLM's "fp8" is e4m3
# wherever it has it), or int8 with a scale per part of a row: vLLM's int8_per_token_head (a part of a latent or
# shared K=V row is the one head's), the form torch_npu quantises to (npu_dynamic_quant)
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
INT8_CACHE_DTYPES = ("int8_per_token_head",)
EIGHT_BIT_CACHE_DTYPES = FP8_CACHE_DTYPES + INT8_CACHE_DTYPES
EIGHT_BIT_SCALE_BYTES = 4  # the 8-bit cache keeps one float32 scale per part of a row


def eight_bit_row_bytes(parts) -> int:
    """Bytes of one 8-bit cached row of parts of ``parts`` values: a byte a value, a scale a part."""
    return sum(parts) + EIGHT_BIT_SCALE_BYTES * len(parts)


def cache_dtype_refusal(vllm_config, what: str, *, eight_bit: bool = False) -> str | None:
    """One line refusing a cache-dtype flag the adapter does not honour (None: every flag is 'auto' or names
    the model dtype, which is what the adapter stores ``what`` in, or, with ``eight_bit``, ``--kv-cache-dtype``
    names an 8-bit format the adapter also stores it in: ``EIGHT_BIT_CACHE_DTYPES``)."""
    import torch

    dtype = vllm_config.model_config.dtype
    model_dtype = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else str(dtype)
    if eight_bit and str(getattr(vllm_config.cache_config, "cache_dtype", "auto")) in FP8_CACHE_DTYPES:
        from ascend_adapters.common.platform import KernelPath, kernel_path

        if kernel_path() is KernelPath.NPU:
            # torch_npu-npu_quantize.md 参数说明, dtype: qint8, quint8, int32, quint4x2 (Atlas A2/A3)
            return (
                f"--kv-cache-dtype {vllm_config.cache_config.cache_dtype} is not served on an Ascend NPU: {what} would "
                "be stored as float8 e4m3, for which torch_npu documents no Atlas A2/A3 kernel (npu_quantize "
                f"writes qint8, quint8, int32 or quint4x2); serve with --kv-cache-dtype {INT8_CACHE_DTYPES[0]} "
                "(int8, npu_dynamic_quant) or auto"
            )
    served = ("auto", model_dtype)
    for attr, flag in CACHE_DTYPE_FLAGS.items():
        asked = str(getattr(vllm_config.cache_config, attr, "auto"))
        served_here = served + (EIGHT_BIT_CACHE_DTYPES if eight_bit and attr == "cache_dtype" else ())
        if asked not in served_here:
            also = f" or 8-bit ({flag} {' / '.join(EIGHT_BIT_CACHE_DTYPES)})" if len(served_here) > len(served) else ""
            return (
                f"{flag} {asked} is not served: {what} is stored in the model dtype ({model_dtype}){also}; "
                f"serve with {flag} auto"
            )
    return None


def speculation_refusal(vllm_config, methods: tuple[str, ...]) -> str | None:
    """Why a speculative config is refused (None: none asked for, or a method the adapter serves).

    ``methods`` is the adapter's ``SPECULATIVE_METHODS`` (its hook module), which
    ``ascend-adapters status`` reports too, so the refusal and the report cannot disagree.
    """
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None
    method = getattr(spec, "method", None)
    if method in methods:
        return None
    served = ", ".join(methods) if methods else "none"
    return (
        f"speculative decoding method {method!r} is not served by this adapter (served: {served}); "
        "serve without --speculative-config"
    )


def route_mtp_draft(
    vllm_config,
    *,
    arch: str,
    drafter: str,
    engine_names: tuple[str, ...],
    error: type[Exception] = ValueError,
    prepare=None,
) -> None:
    """Point ``--speculative-config '{"method": "mtp"}'``'s draft model at the adapter's own MTP drafter.

    vLLM names the draft of a target after its own MTP class (``SpeculativeConfig.hf_config_override``,
    per engine: ``engine_names``), which does not run beside the adapter's layers. This rewrites the
    draft config's ``architectures`` to ``drafter`` (registered by the adapter's hook under a name of its
    own, so vLLM's MTP classes stay as they are for other models) and tells vLLM (``update_arch_``).
    ``prepare(draft_hf_config)`` fixes up the draft config first. Refused, in one line each: a draft name
    the adapter was not tested with, a checkpoint without MTP layer, pipeline parallelism (vLLM's
    proposer shares the target's embedding and head with the drafter only on one stage)."""
    spec = vllm_config.speculative_config
    draft = spec.draft_model_config
    named = list(draft.hf_config.architectures or [])
    if named != [drafter] and not set(named) & set(engine_names):
        raise error(
            f"{arch} (ascend-adapters): this vLLM names the MTP draft {named}, not one of "
            f"{list(engine_names)}; the adapter's drafter is untested with it. Serve without "
            "--speculative-config"
        )
    if not int(getattr(draft.hf_text_config, "num_nextn_predict_layers", 0) or 0):
        raise error(
            f"{arch} (ascend-adapters): speculative method 'mtp' needs the checkpoint's MTP layer, and "
            "config.json num_nextn_predict_layers is 0 or missing. Serve without --speculative-config"
        )
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp > 1:
        raise error(
            f"{arch} (ascend-adapters): speculative method 'mtp' with pipeline_parallel_size={pp} is not "
            "served (vLLM shares the target's embedding and LM head with the drafter only without pipeline "
            "parallelism). Use --pipeline-parallel-size 1 or serve without --speculative-config"
        )
    if prepare is not None:
        prepare(draft.hf_config)
    draft.hf_config.architectures = [drafter]
    spec.update_arch_()


# common's routed-expert ops (common.kernels.experts, common.quant.moe): opaque calls of a known output
# shape, run between the compiled pieces like the adapters' attention and state ops (the float and W8A8
# ops read nothing on the host, so a whole captured decode step may hold them; the vLLM-CPU engine path
# reads its groups' bounds on the host and serves only the CPU, which captures no graph)
EXPERT_OPS = (
    "vllm::ascend_adapters_swiglu_experts",
    "vllm::ascend_adapters_w8a8_dynamic_moe",
    "vllm::ascend_adapters_engine_swiglu_experts",
)


def adapter_splitting_ops(ops: Iterable[str]) -> list[str]:
    """The ops vLLM runs eagerly between compiled pieces for an adapter whose own such ops are ``ops``:
    those, then common's routed-expert ops (``EXPERT_OPS``), which any of its layers may call."""
    ops = list(ops)
    return [*ops, *(op for op in EXPERT_OPS if op not in ops)]


def compile_split_at(vllm_config, ops: Iterable[str]) -> None:
    """Let vLLM compile an adapter's model, with its state or attention ops ``ops`` as splitting ops.

    Piecewise compilation (vLLM's CUDA graph modes, vllm-ascend's ACL graph) runs the splitting ops
    eagerly between compiled graph pieces; an adapter's op that reads its step's metadata on the host
    must be one of them, as must common's routed-expert ops (``EXPERT_OPS``). This runs while vLLM
    builds its config, before it fills in its default list (None), which is then named here.

    vLLM also turns compilation off by architecture name for the models its own classes cannot compile
    (``VLLM_USE_BREAKABLE_CUDAGRAPH`` auto-enabled, compilation mode none: ``GlmMoeDsaForCausalLM`` in
    0.32, ``DeepseekV4ForCausalLM`` in 0.27.1 through 0.32), unless that variable is set. The adapter's
    model compiles, so it is set to 0 where the user has not set it (the per-architecture hook runs
    before vLLM's check, and the engine's processes inherit the variable).
    """
    import os

    from vllm.config import CompilationMode

    os.environ.setdefault("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
    cc = vllm_config.compilation_config
    if cc.mode not in (None, CompilationMode.VLLM_COMPILE):
        return
    current = list(type(cc)._attention_ops) if cc.splitting_ops is None else list(cc.splitting_ops)
    cc.splitting_ops = [*current, *(op for op in adapter_splitting_ops(ops) if op not in current)]
