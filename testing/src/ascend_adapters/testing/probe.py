"""A tiny probe plugin living in the test layer.

It is declared as a `vllm.general_plugins` entry point of common but
registers nothing unless ``ASCEND_ADAPTERS_TEST_PROBE=1`` is set, so user
installs never see it. With it set, it registers architectures that wrap
vLLM's own Llama, selected with
``--hf-overrides '{"architectures": ["AscendProbeLlamaForCausalLM"]}'``:

* ``AscendProbeLlamaForCausalLM``: vLLM's Llama unchanged; proves plugin
  discovery in vLLM's subprocesses.
* ``AscendProbeCrashingLlamaForCausalLM``: starts, then raises on the first
  forward of a real request ("false ready").
* ``AscendProbeMisloadLlamaForCausalLM``: a weight-mapping bug (it rejects a
  real checkpoint name) that dummy weights never reach.
"""

from __future__ import annotations

from ascend_adapters.common.flags import env_flag

PROBE_ENV = "ASCEND_ADAPTERS_TEST_PROBE"
_MODULE = "ascend_adapters.testing.probe_models"

PROBE_ARCHITECTURES = {
    "AscendProbeLlamaForCausalLM": f"{_MODULE}:ProbeLlamaForCausalLM",
    "AscendProbeCrashingLlamaForCausalLM": f"{_MODULE}:ProbeCrashingLlamaForCausalLM",
    "AscendProbeMisloadLlamaForCausalLM": f"{_MODULE}:ProbeMisloadLlamaForCausalLM",
}


def register() -> None:
    if not env_flag(PROBE_ENV):
        return
    from ascend_adapters.common.registry import register_architectures

    register_architectures(PROBE_ARCHITECTURES)
