"""common.loading at a pipeline stage: tensors of modules another stage holds (``PPMissingLayer``) are
skipped with that reason, never handed to a model's own ``load_weights`` (which would not find them),
and not counted as missing; a tensor this stage needs is still refused when absent."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from vllm.model_executor.models.utils import PPMissingLayer

from ascend_adapters.common.loading import PIPELINE_STAGE_REASON, CheckpointError, load_checkpoint


class _Backbone(nn.Module):
    """Layer 0 on this stage, layer 1 on the next; loads by its own names, as vLLM's models do."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2, bias=False), PPMissingLayer()])

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            param = params[name]  # a name this stage does not own fails here
            param.weight_loader(param, tensor)
            loaded.add(name)
        return loaded


class _FirstStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = _Backbone()
        self.lm_head = PPMissingLayer()


CHECKPOINT = {
    "model.layers.0.weight": torch.full((2, 2), 3.0),
    "model.layers.1.weight": torch.full((2, 2), 4.0),
    "lm_head.weight": torch.full((5, 2), 5.0),
}


def test_other_stage_tensors_skipped_with_reason():
    model = _FirstStage()
    load_checkpoint(model, CHECKPOINT.items(), what="toy")
    assert torch.equal(model.model.layers[0].weight.data, CHECKPOINT["model.layers.0.weight"])
    assert model.skipped_weights == {
        "model.layers.1.weight": PIPELINE_STAGE_REASON,
        "lm_head.weight": PIPELINE_STAGE_REASON,
    }


def test_own_stage_tensor_still_required():
    own = "model.layers.0.weight"
    with pytest.raises(CheckpointError, match=own.replace(".", r"\.")):
        load_checkpoint(_FirstStage(), [(n, t) for n, t in CHECKPOINT.items() if n != own], what="toy")
