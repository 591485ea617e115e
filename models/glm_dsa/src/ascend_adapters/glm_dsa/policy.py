"""What this adapter refuses at start-up, with the reason and the fix.

Installed through ``ascend_adapters.common.policy`` on vLLM's per-architecture
config hook for ``GlmMoeDsaForCausalLM``, over vLLM's own class for it: vLLM's
checks run first, then ``check_startup``: speculative decoding only with the
checkpoint's MTP layer (``mtp``, see ``route_mtp_draft``), cache-dtype flags other than
the model dtype (the latent cache is stored in it), the checkpoint's
``index_topk`` is present in config.json, and an attention path exists for
``max_model_len`` (fails closed when the sparse path is disabled). It also makes
the attention op a splitting op of vLLM's piecewise compilation.
"""

from __future__ import annotations

ARCH = "GlmMoeDsaForCausalLM"

# what each engine's SpeculativeConfig.hf_config_override names the draft of a glm_moe_dsa target:
# vLLM 0.27.1 and 0.28.0 its DeepSeek-V3 MTP, 0.32 its DeepSeek-V3.2 one
ENGINE_DRAFT_ARCHITECTURES = ("DeepSeekMTPModel", "DeepseekV32MTPModel")


def route_mtp_draft(vllm_config) -> None:
    """Point the MTP draft model at this adapter's drafter (``mtp.GlmMoeDsaMTP``) instead of the DeepSeek
    MTP class vLLM names, which builds vLLM's own MLA attention around the checkpoint (start-up then
    fails: ``topk_indices_buffer is not supported for DeepseekV2Attention``)."""
    from ascend_adapters.common.policy import route_mtp_draft as route
    from ascend_adapters.glm_dsa import DRAFT_ARCHITECTURES
    from ascend_adapters.glm_dsa.config import GlmDsaConfigError

    drafter = next(iter(DRAFT_ARCHITECTURES))
    route(vllm_config, arch=ARCH, drafter=drafter, engine_names=ENGINE_DRAFT_ARCHITECTURES, error=GlmDsaConfigError)


def check_startup(vllm_config) -> None:
    from ascend_adapters.common.policy import cache_dtype_refusal, compile_split_at, speculation_refusal
    from ascend_adapters.glm_dsa import SPECULATIVE_METHODS, SPLITTING_OPS
    from ascend_adapters.glm_dsa.config import (
        GlmDsaConfigError,
        check_raw_config,
        choose_attention_mode,
        raw_config_dict,
    )

    refusal = cache_dtype_refusal(vllm_config, "the latent cache (kv_c, k_pe, indexer keys)", eight_bit=True)
    refusal = refusal or speculation_refusal(vllm_config, SPECULATIVE_METHODS)
    if refusal:
        raise GlmDsaConfigError(f"{ARCH} (ascend-adapters): {refusal}")
    if vllm_config.speculative_config is not None:
        route_mtp_draft(vllm_config)
    mc = vllm_config.model_config
    check_raw_config(raw_config_dict(mc.model, getattr(mc, "revision", None)))
    choose_attention_mode(mc.hf_text_config, mc.max_model_len)
    compile_split_at(vllm_config, SPLITTING_OPS)


def install() -> None:
    """Idempotent."""
    from ascend_adapters.common.policy import install_policy

    install_policy([ARCH], check_startup, name="GlmDsaStartupPolicy")
