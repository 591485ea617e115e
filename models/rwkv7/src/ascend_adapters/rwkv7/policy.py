"""What this adapter refuses at start-up, with the reason and the fix.

Installed through ``ascend_adapters.common.policy`` on vLLM's per-architecture
config hook, over vLLM's ``MambaModelConfig`` (which sizes the state-cache
block): vLLM's checks run first, then ``check_startup``, which also compares
config.json with the safetensors headers of a local checkpoint (a mismatch
names the tensor).
"""

from __future__ import annotations


class Rwkv7UnsupportedError(ValueError):
    pass


def unsupported_reasons(vllm_config) -> list[str]:
    reasons = []
    par = vllm_config.parallel_config
    if par.tensor_parallel_size > 1:
        reasons.append(
            f"tensor parallelism (tensor_parallel_size={par.tensor_parallel_size}) is not supported by the RWKV-7 "
            "adapter yet: serve with --tensor-parallel-size 1 (use data parallelism to scale out)"
        )
    if par.pipeline_parallel_size > 1:
        reasons.append(f"pipeline parallelism (pipeline_parallel_size={par.pipeline_parallel_size}) is not supported")
    if vllm_config.speculative_config is not None:
        reasons.append("speculative decoding is not supported: the recurrent state cannot roll back rejected tokens")
    if vllm_config.cache_config.enable_prefix_caching:
        reasons.append(
            "prefix caching is not supported: RWKV-7 keeps one recurrent state per sequence and no per-block "
            "checkpoints to reuse; drop --enable-prefix-caching"
        )
    return reasons


def check_startup(vllm_config) -> None:
    from ascend_adapters.rwkv7.config import check_checkpoint_dir

    # config.json and weight shapes, before any engine process starts
    check_checkpoint_dir(vllm_config.model_config.hf_config, vllm_config.model_config.model)
    reasons = unsupported_reasons(vllm_config)
    if reasons:
        raise Rwkv7UnsupportedError("RWKV-7 adapter: " + "; ".join(reasons))


def install() -> None:
    """Idempotent."""
    from vllm.model_executor.models.config import MambaModelConfig

    from ascend_adapters.common.policy import install_policy
    from ascend_adapters.rwkv7 import ARCHITECTURES

    install_policy(ARCHITECTURES, check_startup, base=MambaModelConfig, name="Rwkv7StartupPolicy")
