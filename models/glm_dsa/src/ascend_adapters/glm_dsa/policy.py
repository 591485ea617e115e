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
# the attention op model.py registers; named here so the start-up hook need not import the model
ATTENTION_OP = "vllm::glm_dsa_attention"


def check_startup(vllm_config) -> None:
    from ascend_adapters.common.policy import speculation_refusal
    from ascend_adapters.glm_dsa import SPECULATIVE_METHODS
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
    _compile_split_at_attention(vllm_config.compilation_config)


def _compile_split_at_attention(compilation_config) -> None:
    """Compile the adapter's model, split at its attention op.

    vLLM 0.32 turns compilation off for ``GlmMoeDsaForCausalLM`` by name: its own class has no
    ``@support_torch_compile``, so it auto-enables breakable CUDA graphs (``VLLM_USE_BREAKABLE_CUDAGRAPH``,
    compilation mode none) unless that variable is set. The adapter's model compiles, so it sets the
    variable to 0 when the user has not (this hook runs before vLLM's check; the engine's processes
    inherit it). Piecewise compilation (vLLM's CUDA and NPU graph modes) then runs the splitting ops
    eagerly between graph pieces; the DSA attention reads its step's metadata on the host, so it must
    be one. This runs before vLLM fills in its default list (None), which is then named here."""
    import os

    from vllm.config import CompilationMode

    os.environ.setdefault("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
    ops = compilation_config.splitting_ops
    if compilation_config.mode in (None, CompilationMode.VLLM_COMPILE) and ATTENTION_OP not in (ops or ()):
        default = type(compilation_config)._attention_ops
        compilation_config.splitting_ops = [*(default if ops is None else ops), ATTENTION_OP]


def install() -> None:
    """Idempotent."""
    from ascend_adapters.common.policy import install_policy

    install_policy([ARCH], check_startup, name="GlmDsaStartupPolicy")
