"""Run on each pipeline stage's model through ``LLM.apply_model``: what the stage holds.

Imported by the engine's worker processes (the test puts this directory on ``PYTHONPATH``).
"""

from __future__ import annotations


def stage_layout(model) -> dict:
    from vllm.distributed import get_pp_group
    from vllm.model_executor.models.utils import PPMissingLayer

    inner = model.model
    held = [i for i, layer in enumerate(inner.layers) if not isinstance(layer, PPMissingLayer)]
    return {
        "pp_rank": get_pp_group().rank_in_group,
        "start_layer": inner.start_layer,
        "end_layer": inner.end_layer,
        "held_layers": held,
        # layers whose state-cache tensors vLLM bound (its Mamba state cache, per layer)
        "state_layers": [i for i in held if len(inner.layers[i].kv_cache) == 4],
        "embeddings": not isinstance(inner.embeddings, PPMissingLayer),
        "norm": not isinstance(inner.norm, PPMissingLayer),
        "lm_head": not isinstance(model.lm_head, PPMissingLayer),
        "parameters": sorted(name for name, _ in model.named_parameters()),
        "skipped_weights": dict(getattr(model, "skipped_weights", {})),
    }
