"""What this adapter refuses at start-up, with the reason and the fix.

Installed through ``ascend_adapters.common.policy`` on vLLM's per-architecture
config hook for ``GlmMoeDsaForCausalLM``, over vLLM's own class for it: vLLM's
checks run first, then ``check_startup``: no speculative decoding (vLLM would
build its own DeepSeek-V3.2 MTP drafter around this checkpoint, which cannot run
beside the adapter's attention), the checkpoint's ``index_topk`` is present in
config.json, and an attention path exists for ``max_model_len`` (fails closed
when the sparse path is disabled). It also makes the attention op a splitting op
of vLLM's piecewise compilation.
"""

from __future__ import annotations

ARCH = "GlmMoeDsaForCausalLM"


def check_startup(vllm_config) -> None:
    from ascend_adapters.common.policy import compile_split_at, speculation_refusal
    from ascend_adapters.glm_dsa import SPECULATIVE_METHODS, SPLITTING_OPS
    from ascend_adapters.glm_dsa.config import (
        GlmDsaConfigError,
        check_raw_config,
        choose_attention_mode,
        raw_config_dict,
    )

    refusal = speculation_refusal(vllm_config, SPECULATIVE_METHODS)
    if refusal:
        raise GlmDsaConfigError(f"{ARCH} (ascend-adapters): {refusal}")
    mc = vllm_config.model_config
    check_raw_config(raw_config_dict(mc.model, getattr(mc, "revision", None)))
    choose_attention_mode(mc.hf_text_config, mc.max_model_len)
    compile_split_at(vllm_config, SPLITTING_OPS)


def install() -> None:
    """Idempotent."""
    from ascend_adapters.common.policy import install_policy

    install_policy([ARCH], check_startup, name="GlmDsaStartupPolicy")
