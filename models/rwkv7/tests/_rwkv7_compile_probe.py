"""Run on the worker's model through ``LLM.apply_model``: what vLLM's compilation did there.

Imported by the engine's worker process (the test puts this directory on ``PYTHONPATH``).
"""

from __future__ import annotations


def compilation_counters(model) -> dict:
    import dataclasses

    from vllm.compilation.counter import compilation_counter

    return dataclasses.asdict(compilation_counter)
