"""What this adapter refuses at engine configuration time, with a clear message.

vLLM calls ``verify_and_update_config`` of ``MODELS_CONFIG_MAP[architecture]``
while it builds its config (in the API/LLM process, before any worker starts).
``Rwkv7EngineConfig`` extends vLLM's ``MambaModelConfig`` (which sizes the
state-cache block) with the checks below, and checks config.json against the safetensors
headers of a local checkpoint (a mismatch names the tensor).
"""

from __future__ import annotations

from vllm.model_executor.models.config import MambaModelConfig


class Rwkv7UnsupportedError(ValueError):
    pass


def unsupported_reasons(vllm_config) -> list[str]:
    reasons = []
    par = vllm_config.parallel_config
    tp = par.tensor_parallel_size
    cfg = vllm_config.model_config.hf_config
    heads = cfg.hidden_size // cfg.head_dim
    if tp > 1 and heads % tp:
        reasons.append(
            f"tensor parallelism splits heads across ranks: {heads} heads are not divisible by "
            f"tensor_parallel_size={tp}"
        )
    if par.pipeline_parallel_size > 1:
        reasons.append(f"pipeline parallelism (pipeline_parallel_size={par.pipeline_parallel_size}) is not supported")
    cache = vllm_config.cache_config
    if cache.enable_prefix_caching and getattr(cache, "mamba_cache_mode", "align") not in ("none", "align"):
        reasons.append(
            f"prefix caching with mamba_cache_mode={cache.mamba_cache_mode!r} is not supported: RWKV-7 keeps "
            "states at block boundaries ('align', the default with --enable-prefix-caching)"
        )
    if vllm_config.speculative_config is not None:
        reasons.append("speculative decoding is not supported: the recurrent state cannot roll back rejected tokens")
    return reasons


class Rwkv7EngineConfig(MambaModelConfig):
    @classmethod
    def verify_and_update_config(cls, vllm_config) -> None:
        from ascend_adapters.rwkv7.config import check_checkpoint_dir

        # config.json and weight shapes, before any engine process starts
        check_checkpoint_dir(vllm_config.model_config.hf_config, vllm_config.model_config.model)
        reasons = unsupported_reasons(vllm_config)
        if reasons:
            raise Rwkv7UnsupportedError("RWKV-7 adapter: " + "; ".join(reasons))
        cache = vllm_config.cache_config
        if cache.enable_prefix_caching and cache.mamba_cache_mode == "none":
            # some engines would pick 'all' (per-token states inside the kernels) for a model that
            # supports mamba prefix caching; RWKV-7 copies whole states at block boundaries
            cache.mamba_cache_mode = "align"
        super().verify_and_update_config(vllm_config)
