"""The one place that knows about vLLM engine versions.

Adapters and the quant layer reach vLLM internals that moved or changed between engine versions
through this package only: no version checks anywhere else. Its rooms:

- ``engine_range``: the supported range (vLLM ``ENGINE_MIN`` through ``ENGINE_MAX_SERIES``; tested on
  ``TESTED_RELEASES``), the engine's release, and the start-up refusal outside it.
- ``shims``: each engine difference behind a named function, detected from the engine's own API.
- ``engine_faults``: an engine that dies while serving makes ``vllm serve`` exit non-zero, naming the cause.
- ``request_guard``: request checks the engine leaves out (prompt token ids against the model's vocabulary),
  wrapped around the engine's own prompt validation.

Callers write ``from ascend_adapters.common import compat; compat.X``; every public name of its
rooms is here. (CPU-platform patches every supported engine needs are not version shims:
``common.cpu_patches``; a CPU patch for one release's behaviour is a shim here.)
"""

from __future__ import annotations

from ascend_adapters.common.compat.engine_faults import (
    ENGINE_DIED_EXIT,
    ENGINE_DIED_PREFIX,
    FAULT_FILE_ENV,
    engine_death_line,
    exit_nonzero_on_engine_death,
)
from ascend_adapters.common.compat.engine_range import (
    ENGINE_MAX_SERIES,
    ENGINE_MIN,
    ENGINE_OVERRIDE_ENV,
    ENGINE_RANGE,
    ENGINE_RANGE_TEXT,
    PRIMARY_ENGINE_SERIES,
    TESTED_RELEASES,
    EngineVersionError,
    engine_check,
    engine_in_range,
    engine_release,
    engine_status,
    engine_version,
    is_primary_engine,
    require_supported_engine,
)
from ascend_adapters.common.compat.request_guard import (
    first_out_of_vocab,
    out_of_vocab_message,
    refuse_out_of_vocab_token_ids,
    served_by_adapter,
)
from ascend_adapters.common.compat.shims import (
    MhcOpClasses,
    block_outermost_kv_cache_layouts,
    compressed_attention_spec,
    cpu_float_gemm,
    cpu_int8_gemm,
    drop_other_stages_kv_cache_tensors,
    enable_cpu_float_moe_on_amx,
    force_fp32_compute,
    keep_cpu_linear_weight_dtype,
    latent_kv_cache_shape,
    latent_layer_cache,
    mhc_op_classes,
    mla_attention_spec,
    moe_method_routes,
    moe_select_experts,
    packed_groups_split_by_bytes,
    register_opaque_op,
    retain_prefix_checkpoints,
    sliding_window_row_spec,
    weights_mapper_fn,
)

__all__ = [
    "ENGINE_DIED_EXIT",
    "ENGINE_DIED_PREFIX",
    "ENGINE_MAX_SERIES",
    "ENGINE_MIN",
    "ENGINE_OVERRIDE_ENV",
    "ENGINE_RANGE",
    "ENGINE_RANGE_TEXT",
    "PRIMARY_ENGINE_SERIES",
    "TESTED_RELEASES",
    "FAULT_FILE_ENV",
    "EngineVersionError",
    "MhcOpClasses",
    "block_outermost_kv_cache_layouts",
    "packed_groups_split_by_bytes",
    "compressed_attention_spec",
    "cpu_float_gemm",
    "cpu_int8_gemm",
    "drop_other_stages_kv_cache_tensors",
    "enable_cpu_float_moe_on_amx",
    "engine_check",
    "engine_death_line",
    "engine_in_range",
    "engine_release",
    "engine_status",
    "engine_version",
    "first_out_of_vocab",
    "exit_nonzero_on_engine_death",
    "force_fp32_compute",
    "is_primary_engine",
    "keep_cpu_linear_weight_dtype",
    "latent_kv_cache_shape",
    "latent_layer_cache",
    "mhc_op_classes",
    "mla_attention_spec",
    "out_of_vocab_message",
    "sliding_window_row_spec",
    "moe_method_routes",
    "moe_select_experts",
    "refuse_out_of_vocab_token_ids",
    "register_opaque_op",
    "retain_prefix_checkpoints",
    "require_supported_engine",
    "served_by_adapter",
    "weights_mapper_fn",
]
