"""ModelSlim W8A8 kernels behind ``ascend_adapters.common.dispatch``.

Importing this package registers both implementations of each op:
``modelslim.pack_weight``, ``modelslim.pack_input_quant``, ``modelslim.pack_moe_scale``
(the layouts and scale forms made once after loading), ``modelslim.w8a8_dynamic_linear``,
``modelslim.w8a8_static_linear`` and ``modelslim.w8a8_dynamic_moe``.
The NPU module imports torch_npu only inside its functions.
"""

from ascend_adapters.common.quant.kernels import npu, portable  # noqa: F401

OPS = (
    "modelslim.pack_weight",
    "modelslim.pack_input_quant",
    "modelslim.pack_moe_scale",
    "modelslim.w8a8_dynamic_linear",
    "modelslim.w8a8_static_linear",
    "modelslim.w8a8_dynamic_moe",
)
