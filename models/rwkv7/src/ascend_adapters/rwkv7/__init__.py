"""ascend-adapters rwkv7: the `vllm.general_plugins` hook.

vLLM calls `register()` in every process it starts, so it stays idempotent and
cheap: lazy "module:Class" registration of the model, plus the config class
(``model_type: rwkv7``), the World tokenizer class, the start-up policy
(``policy.py``: state-cache sizing; refusing speculative methods other than n-gram, a head count
that tensor parallelism cannot split, and more pipeline stages than layers) and the two CPU-platform
patches of vLLM this model needs (``common.cpu_patches``: the state-block copy of prefix caching and
the receive buffers of a later pipeline stage; nothing changes on NPU and GPU), applied here once
rather than when a model is built.
"""

from __future__ import annotations

_MODEL = "ascend_adapters.rwkv7.model:Rwkv7ForCausalLM"

# speculative decoding methods this adapter serves (its start-up policy refuses any other; status reports it)
SPECULATIVE_METHODS: tuple[str, ...] = ("ngram",)
# the model's state ops (registered by model.py), where vLLM's compiled graph splits (policy.py; status)
SPLITTING_OPS: tuple[str, ...] = ("vllm::rwkv7_token_shift", "vllm::rwkv7_wkv")

# architecture name -> "module:Class"
ARCHITECTURES: dict[str, str] = {
    "RWKV7ForCausalLM": _MODEL,  # flash-linear-attention's HF layout (released HF checkpoints)
    "Rwkv7ForCausalLM": _MODEL,
}


def register() -> None:
    from ascend_adapters.common import cpu_patches
    from ascend_adapters.common.registry import register_architectures
    from ascend_adapters.rwkv7 import policy
    from ascend_adapters.rwkv7.config import register_config
    from ascend_adapters.rwkv7.tokenizer import register_tokenizer

    register_config()
    register_tokenizer()
    register_architectures(ARCHITECTURES)
    policy.install()
    cpu_patches.enable_cpu_mamba_state_copy()  # prefix caching ("align" mode)
    cpu_patches.enable_cpu_pipeline_receive_buffers()  # pipeline parallelism
