"""What this adapter refuses at start-up, with the reason and the fix.

Installed through ``ascend_adapters.common.policy`` on vLLM's per-architecture
config hook, over vLLM's ``MambaModelConfig`` (which sizes the state-cache
block). ``check_startup`` runs before vLLM's hooks, because it sets the
state-cache mode that ``MambaModelConfig`` sizes blocks for; it also compares
config.json with the safetensors headers of a local checkpoint (a mismatch
names the tensor).
"""

from __future__ import annotations


class Rwkv7UnsupportedError(ValueError):
    pass


def unsupported_reasons(vllm_config) -> list[str]:
    from ascend_adapters.common.policy import cache_dtype_refusal

    reasons = [r for r in (cache_dtype_refusal(vllm_config, "the recurrent state"),) if r]
    par = vllm_config.parallel_config
    tp = par.tensor_parallel_size
    cfg = vllm_config.model_config.hf_config
    heads = cfg.hidden_size // cfg.head_dim
    if tp > 1 and heads % tp:
        reasons.append(
            f"tensor parallelism splits heads across ranks: {heads} heads are not divisible by "
            f"tensor_parallel_size={tp}"
        )
    pp, layers = par.pipeline_parallel_size, cfg.num_hidden_layers
    if pp > layers:
        reasons.append(
            f"pipeline parallelism splits the layers across stages: pipeline_parallel_size={pp} exceeds the "
            f"{layers} layers (every stage needs at least one)"
        )
    cache = vllm_config.cache_config
    if cache.enable_prefix_caching and getattr(cache, "mamba_cache_mode", "align") not in ("none", "align"):
        reasons.append(
            f"prefix caching with mamba_cache_mode={cache.mamba_cache_mode!r} is not supported: RWKV-7 keeps "
            "states at block boundaries ('align', the default with --enable-prefix-caching)"
        )
    from ascend_adapters.common.policy import speculation_refusal
    from ascend_adapters.rwkv7 import SPECULATIVE_METHODS

    refusal = speculation_refusal(vllm_config, SPECULATIVE_METHODS)
    if refusal:
        reasons.append(f"{refusal} (RWKV-7 has no draft model; n-gram drafts need none)")
    elif vllm_config.speculative_config is not None and cache.enable_prefix_caching:
        reasons.append(
            "speculative decoding with prefix caching is not supported: in vLLM's 'align' mode the state rows "
            "of accepted drafts are moved to their block only for hybrid models; serve without "
            "--enable-prefix-caching"
        )
    elif vllm_config.speculative_config is not None and pp > 1:
        reasons.append(
            f"speculative decoding with pipeline_parallel_size={pp} is not supported: vLLM builds the proposer "
            "on the last stage only (vLLM 0.32's runner then fails at start-up on the other stages), and the "
            "earlier stages' recurrent states would need each step's accepted-draft count; serve with "
            "tensor parallelism or without --speculative-config"
        )
    return reasons


def check_startup(vllm_config) -> None:
    from ascend_adapters.rwkv7.config import check_checkpoint_dir

    # config.json and weight shapes, before any engine process starts
    check_checkpoint_dir(vllm_config.model_config.hf_config, vllm_config.model_config.model)
    reasons = unsupported_reasons(vllm_config)
    if reasons:
        raise Rwkv7UnsupportedError("RWKV-7 adapter: " + "; ".join(reasons))
    from ascend_adapters.common.policy import compile_split_at
    from ascend_adapters.rwkv7 import SPLITTING_OPS

    compile_split_at(vllm_config, SPLITTING_OPS)
    cache = vllm_config.cache_config
    if cache.enable_prefix_caching and cache.mamba_cache_mode == "none":
        # some engines would pick 'all' (per-token states inside the kernels) for a model that
        # supports mamba prefix caching; RWKV-7 copies whole states at block boundaries
        cache.mamba_cache_mode = "align"


def install() -> None:
    """Idempotent. Runs before MambaModelConfig's hook, which sizes the state blocks for the cache mode set here."""
    from vllm.model_executor.models.config import MambaModelConfig

    from ascend_adapters.common.policy import install_policy
    from ascend_adapters.rwkv7 import ARCHITECTURES

    install_policy(ARCHITECTURES, check_startup, base=MambaModelConfig, name="Rwkv7StartupPolicy", before_parents=True)
