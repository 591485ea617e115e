"""One served model per ModelSlim method through vLLM with the NPU kernel path forced through the
torch_npu CONTRACT EMULATOR (``testing.npu_emulator``). A contract check on CPU, NOT AN NPU RUN.

The emulator is installed as ``torch_npu`` in every vLLM process (a shim package first on
``PYTHONPATH``) and ``ASCEND_ADAPTERS_NPU_EMULATOR=1`` sends the CPU tensors down the NPU
implementations: ``pack_weight`` to ``[K, N]`` at load, then ``npu_quantize`` / ``npu_dynamic_quant``,
``npu_quant_matmul``, ``npu_grouped_matmul`` and ``npu_swiglu`` on every forward, each call refused if
its documentation does not allow it. The same export is served once more on the portable path; both in
bfloat16 (the dtype these kernels run in on an NPU).

Bound: the two runs are the same vLLM bfloat16 graph except our kernels, whose outputs differ by at
most a few bfloat16 roundings (test_npu_contract.py: <= 6u relative per linear, u = 2**-8) or, rarely,
one int8 step of an activation that sits on a rounding boundary. Through two residual layers and the
LM head that stays at the same relative order, so prompt-position logits (identical inputs in both
runs) must agree within 8u = 2**-5 of the logit scale of the sequence.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from ascend_adapters.testing import npu_emulator  # noqa: E402
from ascend_adapters.testing.parity import vllm_logits  # noqa: E402

pytestmark = [pytest.mark.vllm]

BOUND_REL = 8 * 2.0**-8
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2, 2, 18, 77, 120, 64, 9, 11, 400, 33]]


def _served(model_dir, tmp_path, emulated: bool):
    env, called = npu_emulator.served_env(tmp_path / "emulated") if emulated else ({}, list)
    kwargs = {"quantization": "modelslim", "dtype": "bfloat16"}
    (run,) = vllm_logits(model_dir, [PROMPTS], max_tokens=2, llm_kwargs=kwargs, env=env)
    return run, called()


def _check(model_dir, tmp_path, expected_ops):
    emu, called = _served(model_dir, tmp_path, emulated=True)
    assert set(expected_ops) <= set(called), f"NPU kernel path not taken: emulator saw {called}"
    port, _ = _served(model_dir, tmp_path, emulated=False)
    worst = 0.0
    for a, b in zip(emu, port):
        n = len(a.prompt_ids)
        la, lb = a.logits.float()[:n], b.logits.float()[:n]
        rel = float((la - lb).abs().max() / lb.abs().max())
        worst = max(worst, rel)
    print(f"{model_dir.name}: emulated NPU vs portable, prompt logits max rel diff {worst:.3g} (bound {BOUND_REL:.3g})")
    assert worst <= BOUND_REL, worst


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_w8a8_linear_served_through_npu_emulator(tiny_llama_modelslim_exports, mode, tmp_path):
    from pathlib import Path

    ops = ["npu_quantize", "npu_quant_matmul"] if mode == "static" else ["npu_dynamic_quant", "npu_quant_matmul"]
    _check(Path(tiny_llama_modelslim_exports[mode]), tmp_path, ops)


def test_w8a8_dynamic_moe_served_through_npu_emulator(tmp_path):
    from test_quant_moe_served import PLAN, _float_checkpoint

    from ascend_adapters.testing.modelslim import export_w8a8

    src, out = tmp_path / "float", tmp_path / "export"
    _float_checkpoint(src)
    export_w8a8(src, out, PLAN)
    _check(out, tmp_path, ["npu_dynamic_quant", "npu_grouped_matmul", "npu_swiglu", "npu_quant_matmul"])
