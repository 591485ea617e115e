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
