"""What the portable DeepSeek-V4 model refuses at start-up, with the reason and the fix.

Installed through ``ascend_adapters.common.policy`` on vLLM's per-architecture
config hook, over vLLM's own class for ``DeepseekV4ForCausalLM``: vLLM's checks
run first, then ``check_startup``, before any weights load.
"""

from __future__ import annotations

from ascend_adapters.deepseek_v4.config import (
    ARCH,
    COMPRESSED_ENV,
    LAYER_SLIDING,
    MODEL_TYPE,
    max_exact_len,
    validate_config,
)

# the draft architecture each supported engine's SpeculativeConfig names for a deepseek_v4 target
# (DeepSeekMTPModel: the parser applies the override twice, the second pass sees model_type deepseek_mtp)
ENGINE_DRAFT_ARCHITECTURES = ("DeepSeekV4MTPModel", "DeepSeekMTPModel")


def _restore_compress_ratios(draft_hf_config) -> None:
    # vLLM's proposer sizes its hidden-state buffer for the target's hc_mult streams only when the draft
    # config has compress_ratios (DeepSeek's key, which transformers' config turns into layer_types)
    if not hasattr(draft_hf_config, "compress_ratios"):
        types, rates = draft_hf_config.layer_types, draft_hf_config.compress_rates
        draft_hf_config.compress_ratios = [0 if t == LAYER_SLIDING else rates[t] for t in types]


def route_mtp_draft(vllm_config) -> None:
    """Point the MTP draft model at this adapter's drafter (``mtp.DeepseekV4MTP``) instead of vLLM's
    DeepSeek-V4 MTP (its CUDA kernels; on CPU a stub that raises)."""
    from ascend_adapters.common.policy import route_mtp_draft as route
    from ascend_adapters.deepseek_v4 import DRAFT_ARCHITECTURES

    drafter = next(iter(DRAFT_ARCHITECTURES))
    route(
        vllm_config,
        arch=ARCH,
        drafter=drafter,
        engine_names=ENGINE_DRAFT_ARCHITECTURES,
        prepare=_restore_compress_ratios,
    )


def check_startup(vllm_config) -> None:
    from ascend_adapters.common.policy import cache_dtype_refusal

    refusal = cache_dtype_refusal(vllm_config, "the window, compressed-entry and indexer caches", eight_bit=True)
    if refusal:
        raise ValueError(f"{ARCH} (ascend-adapters portable path): {refusal}")
    model_config = vllm_config.model_config
    hf = model_config.hf_config
    if getattr(hf, "model_type", None) != MODEL_TYPE or not hasattr(hf, "layer_types"):
        raise ValueError(
            f"{ARCH} (ascend-adapters portable path) needs a DeepSeek-V4 config read by transformers' "
            f"DeepseekV4Config; got {type(hf).__name__}. Was the config passed with a non-'hf' "
            "--config-format?"
        )
    validate_config(hf, source=str(model_config.model))
    limit = max_exact_len(hf)
    if limit is not None and model_config.max_model_len > limit:
        raise ValueError(
            f"{ARCH}: max_model_len={model_config.max_model_len} exceeds what is exact with the "
            f"compressed attention branches (CSA/HCA) switched off ({COMPRESSED_ENV}=0): {limit} "
            f"tokens (sliding window {hf.sliding_window}; the first compressed entry joins attention "
            f"at position {min(hf.compress_rates[t] for t in set(hf.layer_types) - {LAYER_SLIDING}) - 1}"
            f"). Use --max-model-len {limit} or unset {COMPRESSED_ENV} (the default serves any length "
            "exactly)."
        )
    quant = model_config.quantization or getattr(hf, "quantization_config", None)
    method = quant if isinstance(quant, str) else (quant or {}).get("quant_method")
    if quant and method != "modelslim":
        hint = (
            " DeepSeek's own FP8/FP4 release is recognised from its config.json and dequantized at "
            "load: drop --quantization."
            if method in ("fp8", "deepseek_v4_fp8")
            else ""
        )
        raise ValueError(
            f"{ARCH} (ascend-adapters portable path): quantization {method or quant!r} is not supported. "
            "Served: float checkpoints (float32/bfloat16), ModelSlim exports (W8A8_DYNAMIC / W8A8, "
            "detected from quant_model_description.json), and DeepSeek's release (quantization_config "
            f"quant_method fp8: FP8 e4m3 block-scaled linears, FP4 e2m1 experts, dequantized at load).{hint}"
        )
    from ascend_adapters.common.policy import speculation_refusal
    from ascend_adapters.deepseek_v4 import SPECULATIVE_METHODS

    refusal = speculation_refusal(vllm_config, SPECULATIVE_METHODS)
    if refusal:
        raise ValueError(f"{ARCH} (ascend-adapters portable path): {refusal}")
    if vllm_config.speculative_config is not None:
        route_mtp_draft(vllm_config)
    if vllm_config.cache_config.enable_prefix_caching:
        from ascend_adapters.common import compat
        from ascend_adapters.deepseek_v4.memory import hit_tokens

        # a prompt sharing any multiple of the hit unit with an earlier one hits, not only one sharing its end
        compat.retain_prefix_checkpoints(vllm_config.cache_config, hit_tokens(hf))
    from ascend_adapters.common.policy import compile_split_at
    from ascend_adapters.deepseek_v4 import SPLITTING_OPS

    compile_split_at(vllm_config, SPLITTING_OPS)


def install() -> None:
    """Idempotent."""
    from ascend_adapters.common.policy import install_policy

    install_policy([ARCH], check_startup, name="DeepseekV4StartupPolicy")
