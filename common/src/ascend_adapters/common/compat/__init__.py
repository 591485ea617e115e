"""The one place that knows about vLLM engine versions.

Adapters and the quant layer reach vLLM internals that moved or changed between engine versions
through this package only: no version checks anywhere else. Two rooms:

- ``engine_range``: the supported range (vLLM ``ENGINE_MIN`` through ``ENGINE_MAX_SERIES``; tested on
  ``TESTED_RELEASES``), the engine's release, and the start-up refusal outside it.
- ``shims``: each engine difference behind a named function, detected from the engine's own API.

Callers write ``from ascend_adapters.common import compat; compat.X``; every public name of both
rooms is here. (CPU-platform patches of vLLM are not version shims: ``common.cpu_patches``.)
"""

from __future__ import annotations

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
from ascend_adapters.common.compat.shims import (
    MhcOpClasses,
    compressed_attention_spec,
    cpu_float_gemm,
    cpu_int8_gemm,
    force_fp32_compute,
    keep_cpu_linear_weight_dtype,
    latent_kv_cache_shape,
    latent_layer_cache,
    mhc_op_classes,
    mla_attention_spec,
    moe_method_routes,
    moe_select_experts,
    register_opaque_op,
    sliding_window_row_spec,
    weights_mapper_fn,
)

__all__ = [
    "ENGINE_MAX_SERIES",
    "ENGINE_MIN",
    "ENGINE_OVERRIDE_ENV",
    "ENGINE_RANGE",
    "ENGINE_RANGE_TEXT",
    "PRIMARY_ENGINE_SERIES",
    "TESTED_RELEASES",
    "EngineVersionError",
    "MhcOpClasses",
    "compressed_attention_spec",
    "cpu_float_gemm",
    "cpu_int8_gemm",
    "engine_check",
    "engine_in_range",
    "engine_release",
    "engine_status",
    "engine_version",
    "force_fp32_compute",
    "is_primary_engine",
    "keep_cpu_linear_weight_dtype",
    "latent_kv_cache_shape",
    "latent_layer_cache",
    "mhc_op_classes",
    "mla_attention_spec",
    "sliding_window_row_spec",
    "moe_method_routes",
    "moe_select_experts",
    "register_opaque_op",
    "require_supported_engine",
    "weights_mapper_fn",
]
