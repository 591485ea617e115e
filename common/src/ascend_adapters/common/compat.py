"""Every difference between the vLLM engine versions this project supports.

Adapters and the quant layer import vLLM internals that moved or changed
between engine versions through this module only: no version checks
anywhere else. Reading the engine version imports nothing from vLLM.
"""

from __future__ import annotations

import functools

from packaging.version import Version

from ascend_adapters.common.versions import engine_distribution


@functools.lru_cache(maxsize=1)
def engine_version() -> Version | None:
    """The installed engine's release (local label such as ``+cpu`` or ``+empty`` dropped), or None."""
    found = engine_distribution()
    if found is None:
        return None
    return Version(Version(found[1]).base_version)


def engine_at_least(version: str) -> bool:
    current = engine_version()
    return current is not None and current >= Version(version)


def cpu_int8_gemm():
    """vLLM-CPU's own oneDNN W8A8 GEMM (``vllm._custom_ops``), or None where the engine build lacks it.

    The returned module offers ``create_onednn_scaled_mm(weight_kn, weight_scale, out_dtype,
    dynamic_quant, use_azp)`` (prepacks the weight once) and ``onednn_scaled_mm(handle, xq, out,
    input_scale, input_zp, input_zp_adj, bias)``; the signatures are the same in vllm-cpu 0.27.1,
    0.28.0 and 0.32.0. Builds without the ``_C`` oneDNN ops (CUDA, NPU, other CPUs) give None.
    """
    try:
        import vllm._custom_ops as ops
    except Exception:
        return None
    if not getattr(ops, "_supports_onednn", False):
        return None
    if not all(hasattr(ops, name) for name in ("create_onednn_scaled_mm", "onednn_scaled_mm")):
        return None
    return ops
