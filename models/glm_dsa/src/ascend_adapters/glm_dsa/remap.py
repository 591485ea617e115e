"""Checkpoint names this adapter accepts (released GLM-5.x exports), as a vLLM ``WeightsMapper``.

The released exports already use the names the model owns
(``model.layers.N.self_attn.q_a_proj.weight``, per-expert
``mlp.experts.E.gate_proj.weight``, ``self_attn.indexer.wq_b.weight`` ...), so
the mapper renames nothing: it drops, on purpose and with a reason, what the
served model does not own. ``hf_to_vllm_mapper`` holds the drops every export
needs (the MTP-only top-level ``rot.weight``, rotary buffers); which MTP layers
and indexers to drop depends on the config and the attention path, so
``skip_rules`` lists them per model and ``skip_mapper`` turns them into the
mapper the model loads with. Any other name the model does not own is an
error of the model's ``load_weights``.
"""

from __future__ import annotations

from ascend_adapters.common.loading import CheckpointError, skip_mapper


class GlmDsaWeightsError(CheckpointError):
    """A checkpoint tensor the model does not own, or one it needs and the checkpoint lacks (named)."""


# (fused parameter, checkpoint shard, shard id): vLLM's stacked_params_mapping for this model
STACKED_PARAMS = [(".gate_up_proj.", ".gate_proj.", 0), (".gate_up_proj.", ".up_proj.", 1)]

# pattern (searched in the checkpoint name) -> why the served model drops the tensor
FIXED_SKIPS = {
    r"^rot\.weight$": "MTP-only top-level tensor; the non-MTP model does not own it",
    r"\.rotary_emb\.inv_freq$": "rotary buffer, recomputed",
}


# the dense attention path has no indexer
DENSE_PATH_SKIPS = {
    r"^model\.layers\.\d+\.self_attn\.indexer\.": "DSA indexer unused on the dense path (every context <= index_topk)"
}

hf_to_vllm_mapper = skip_mapper(FIXED_SKIPS)


def skip_rules(
    num_hidden_layers: int, num_mtp_layers: int, unused_indexer_layers: list[int], dense: bool
) -> dict[str, str]:
    """Every drop for one model: ``FIXED_SKIPS`` plus its MTP layers and the indexers its path does not use."""
    rules = dict(FIXED_SKIPS)
    if num_mtp_layers > 0:
        ids = "|".join(str(num_hidden_layers + i) for i in range(num_mtp_layers))
        rules[rf"^model\.layers\.({ids})\."] = "MTP layer (num_nextn_predict_layers): the MTP drafter loads it (mtp.py)"
    if dense:
        rules.update(DENSE_PATH_SKIPS)
    elif unused_indexer_layers:
        ids = "|".join(str(i) for i in unused_indexer_layers)
        rules[rf"^model\.layers\.({ids})\.self_attn\.indexer\."] = (
            "indexer of a 'shared' layer (reuses the previous layer's top-k)"
        )
    return rules


def mtp_skip_rules(num_hidden_layers: int, num_mtp_layers: int, dense: bool) -> dict[str, str]:
    """Every drop for the MTP drafter (``mtp.py``), which owns only the MTP layers: the main model's
    tensors, and the layers' copies of the embedding and LM head (vLLM's proposer installs the target's)."""
    ids = "|".join(str(num_hidden_layers + i) for i in range(num_mtp_layers))
    rules = {
        rf"^(?!model\.layers\.({ids})\.)": "the target model's tensor; the MTP drafter owns only its MTP layers",
        rf"^model\.layers\.({ids})\.(embed_tokens|shared_head\.head)\.": (
            "the MTP layer's copy of the embedding or LM head; vLLM's proposer shares the target's"
        ),
    }
    if dense:
        rules.update(DENSE_PATH_SKIPS)
    return rules
