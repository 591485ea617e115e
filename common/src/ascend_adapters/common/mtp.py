"""The MTP drafter scaffold every adapter with its own multi-token-prediction layers shares.

vLLM's speculative proposer (``--speculative-config '{"method": "mtp"}'``) drives a drafter shaped like
vLLM's own ``deepseek_mtp.py``: the MTP layers sit after the main stack, ``layers.<num_hidden_layers + i>``
(``num_nextn_predict_layers`` of them, draft step ``s`` taking layer ``s % num_mtp_layers``); at position ``i``
a layer takes the target's final hidden state and the embedding of token ``i + 1`` (zero at position 0, as
vLLM's, SGLang's and vllm-ascend's DeepSeek MTP do), and its ``shared_head`` norm feeds the target's
``lm_head``. The proposer installs the target's ``embed_tokens`` (``model.embed_tokens``) and ``lm_head``
(each layer's ``shared_head.head``) after loading, so neither is built here.

What differs per model stays in its ``mtp.py``: the MTP layer (a subclass of the model's decoder layer with
``predict(input_ids, positions, inputs_embeds, previous_hidden_states)`` and
``head_hidden(hidden_states)``), the draft config, and loading.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor

# vLLM's torch.compile of a drafter: every input's token dimension is dynamic (the positions' last one)
compile_drafter = support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "hidden_states": 0, "inputs_embeds": 0}
)


def mtp_layer_count(config, what: str, error: type[Exception] = ValueError) -> int:
    """``num_nextn_predict_layers``, refused when the checkpoint has no MTP layer to draft with."""
    n = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if n < 1:
        raise error(
            f"{what}: config.json num_nextn_predict_layers is 0 or missing: this checkpoint has no MTP layer to "
            "draft with; serve without --speculative-config"
        )
    return n


class SharedHead(nn.Module):
    """``shared_head``: the MTP layer's final norm (vLLM's ``SharedHead`` with its head deferred); ``head`` is
    the target's ``lm_head``, installed by vLLM's proposer after loading."""

    def __init__(self, config):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.head = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden_states)


class MultiTokenPredictor(nn.Module):
    """The MTP layers, ``layers.<num_hidden_layers + i>``, built by ``make_layer(layer_idx, prefix)``, and the
    target's embedding slot."""

    def __init__(
        self,
        config,
        make_layer: Callable[[int, str], nn.Module],
        *,
        what: str,
        prefix: str = "",
        error: type[Exception] = ValueError,
    ):
        super().__init__()
        self.config = config
        self.mtp_start_layer_idx = config.num_hidden_layers
        self.num_mtp_layers = mtp_layer_count(config, what, error)
        self.embed_tokens = None  # the target's, installed by vLLM's proposer
        ids = range(self.mtp_start_layer_idx, self.mtp_start_layer_idx + self.num_mtp_layers)
        self.layers = nn.ModuleDict({str(i): make_layer(i, f"{prefix}.layers.{i}") for i in ids})

    def layer(self, spec_step_idx: int) -> nn.Module:
        return self.layers[str(self.mtp_start_layer_idx + spec_step_idx % self.num_mtp_layers)]


class MTPDrafter(nn.Module):
    """The drafter vLLM's proposer drives, around a ``MultiTokenPredictor`` (``model``). A model's drafter
    subclasses it with ``@compile_drafter``, builds its predictor and keeps its own ``load_weights``."""

    def __init__(self, model: MultiTokenPredictor):
        super().__init__()
        self.model = model
        self.config = model.config
        self.logits_processor = LogitsProcessor(model.config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        spec_step_idx: int = 0,
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.model.embed_tokens(input_ids)
        inputs_embeds = torch.where(positions[:, None] == 0, 0, inputs_embeds)
        return self.model.layer(spec_step_idx).predict(input_ids, positions, inputs_embeds, hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor | None:
        layer = self.model.layer(spec_step_idx)
        return self.logits_processor(layer.shared_head.head, layer.head_hidden(hidden_states))
