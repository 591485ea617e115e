"""The deployment gate: ``ascend-adapters gate MODEL_DIR [options] -- <vllm serve args>``.

Runs admission (when a manifest is given), then a dummy-weight stage and a
real-weight stage against a real ``vllm serve``, and writes one evidence
record. Importing this package is cheap (no torch, no vLLM). See docs/gate.md.

    from ascend_adapters.common.gate import GateOptions, run_gate
    exit_code = run_gate(GateOptions(model_dir="/models/x", serve_args=["--tensor-parallel-size", "8"]))
"""

from ascend_adapters.common.gate.runner import GATE_NAME, GateOptions, GateResult, run_gate

__all__ = ["GATE_NAME", "GateOptions", "GateResult", "run_gate"]
