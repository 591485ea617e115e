"""Model classes behind the probe plugin (see probe.py)."""

from __future__ import annotations

from vllm.model_executor.models.llama import LlamaForCausalLM


class ProbeLlamaForCausalLM(LlamaForCausalLM):
    """vLLM's Llama, reached through an out-of-tree registration."""


class ProbeCrashingLlamaForCausalLM(LlamaForCausalLM):
    """Starts and profiles fine, then fails on real requests.

    vLLM runs dummy forwards while starting (profiling, warm-up); those carry
    no scheduled request. The crash is tied to a real prompt length so that
    start-up succeeds and the first request fails.
    """

    def forward(self, input_ids, positions, *args, **kwargs):
        if (
            input_ids is not None
            and 0 < input_ids.numel() < 100
            and int(positions.max()) < 100
            and int(input_ids.min()) > 0
        ):
            raise RuntimeError("probe: deliberate failure on the first real forward")
        return super().forward(input_ids, positions, *args, **kwargs)


class ProbeMisloadLlamaForCausalLM(LlamaForCausalLM):
    """Maps names wrongly: real weights fail to load, dummy weights never look."""

    def load_weights(self, weights):
        for name, _ in weights:
            if name.endswith("mlp.down_proj.weight"):
                raise KeyError(f"probe: no parameter for checkpoint tensor {name!r} (deliberate mapping bug)")
        return super().load_weights(weights)
