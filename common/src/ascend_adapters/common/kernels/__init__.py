"""Kernels the adapters share, behind ``ascend_adapters.common.dispatch``.

Each module holds a plain reference (the formula written out, for tests), the fast portable form
registered with ``dispatch.portable`` and, where torch_npu documents an operator for it, the NPU twin
registered with ``dispatch.npu`` (torch_npu imported inside the function only). Importing this
package registers:

* ``common.swiglu`` (``activation``): SwiGLU on ``[gate | up]``, optionally clamped (DeepSeek-V4);
* ``common.swiglu_experts`` (``experts``): routed float experts with that SwiGLU, grouped by expert;
  ``experts.grouped_experts`` routes, sorts and groups on the device for every MoE kernel here (the
  float op and ModelSlim's W8A8 experts), one grouped GEMM per projection;
* ``common.rope_interleaved`` (``rope``): interleaved ("GPT-J") RoPE on the trailing channels;
* ``common.kv8_quantize`` / ``common.kv8_dequantize``, ``common.kv8_int8_quantize`` (NPU twin:
  ``npu_dynamic_quant``) / ``common.kv8_int8_dequantize`` (``kv8``): the 8-bit KV cache's rows (float8 e4m3 or int8
  codes, a float32 scale per part), and ``kv8.CacheRows``, a layer's choice between them and the model dtype.
"""

from ascend_adapters.common.kernels import activation, experts, kv8, rope  # noqa: F401

OPS = (
    "common.swiglu",
    "common.swiglu_experts",
    "common.rope_interleaved",
    "common.kv8_quantize",
    "common.kv8_dequantize",
)
