"""How vLLM's config layer should see a GLM-DSA checkpoint served by this adapter.

vLLM marks ``glm_moe_dsa`` as an MLA model. On CPU that makes the platform
force block size 16 and turn chunked prefill and prefix caching off (its CPU
MLA kernels cannot do them), and elsewhere it selects MLA attention backends.
This adapter does not use vLLM's MLA backends: every layer owns a paged latent
cache with its own portable backend, which handles chunked prefill and cached
prefixes. So for ``glm_moe_dsa`` only, the architecture convertor reports a
non-MLA model; nothing changes for other model types.
"""

from __future__ import annotations

from vllm.transformers_utils.model_arch_config_convertor import (
    MODEL_ARCH_CONFIG_CONVERTORS,
    ModelArchConfigConvertorBase,
)

MODEL_TYPE = "glm_moe_dsa"


class GlmDsaArchConfigConvertor(ModelArchConfigConvertorBase):
    def is_deepseek_mla(self) -> bool:
        return False

    def get_head_size(self) -> int:
        cfg = self.hf_text_config
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim

    def get_total_num_kv_heads(self) -> int:
        return 1  # one latent row per token


def install() -> None:
    """Idempotent; keeps a convertor someone else installed for this model type."""
    MODEL_ARCH_CONFIG_CONVERTORS.setdefault(MODEL_TYPE, GlmDsaArchConfigConvertor)


ARCH = "GlmMoeDsaForCausalLM"


def _verify_class():
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    base = MODELS_CONFIG_MAP.get(ARCH)
    parent = base if base is not None and not getattr(base, "_ascend_adapters_glm_dsa", False) else object

    class GlmDsaVerifyConfig(parent):
        """Start-up checks in vLLM's main process, before any engine process is spawned: the
        checkpoint's index_topk is present, and the attention path for max_model_len exists
        (fails closed when the sparse path is disabled). vLLM's own checks run first."""

        _ascend_adapters_glm_dsa = True

        @classmethod
        def verify_and_update_config(cls, vllm_config) -> None:
            if parent is not object:
                parent.verify_and_update_config(vllm_config)
            from ascend_adapters.glm_dsa.config import check_raw_config, choose_attention_mode, raw_config_dict

            mc = vllm_config.model_config
            check_raw_config(raw_config_dict(mc.model, getattr(mc, "revision", None)))
            choose_attention_mode(mc.hf_text_config, mc.max_model_len)

        @classmethod
        def verify_and_update_model_config(cls, model_config) -> None:
            if parent is not object:
                parent.verify_and_update_model_config(model_config)

    return MODELS_CONFIG_MAP, GlmDsaVerifyConfig


def install_checks() -> None:
    """Idempotent: wrap vLLM's per-architecture config hook for GlmMoeDsaForCausalLM."""
    table, cls = _verify_class()
    if not getattr(table.get(ARCH), "_ascend_adapters_glm_dsa", False):
        table[ARCH] = cls
