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


hf_to_vllm_mapper = skip_mapper(FIXED_SKIPS)


def skip_rules(
    num_hidden_layers: int, num_mtp_layers: int, unused_indexer_layers: list[int], dense: bool
) -> dict[str, str]:
    """Every drop for one model: ``FIXED_SKIPS`` plus its MTP layers and the indexers its path does not use."""
    rules = dict(FIXED_SKIPS)
    if num_mtp_layers > 0:
        ids = "|".join(str(num_hidden_layers + i) for i in range(num_mtp_layers))
        rules[rf"^model\.layers\.({ids})\."] = "MTP layer (num_nextn_predict_layers); not served"
    if dense:
        rules[r"^model\.layers\.\d+\.self_attn\.indexer\."] = (
            "DSA indexer unused on the dense path (every context <= index_topk)"
        )
    elif unused_indexer_layers:
        ids = "|".join(str(i) for i in unused_indexer_layers)
        rules[rf"^model\.layers\.({ids})\.self_attn\.indexer\."] = (
            "indexer of a 'shared' layer (reuses the previous layer's top-k)"
        )
    return rules
