"""Checkpoint names this adapter accepts (released GLM-5.x exports).

The released exports already use the names the model owns
(``model.layers.N.self_attn.q_a_proj.weight``, per-expert
``mlp.experts.E.gate_proj.weight``, ``self_attn.indexer.wq_b.weight`` ...), so
the rules are explicit skips: the MTP-only top-level ``rot.weight``, the MTP
layers that follow the main stack, indexer weights the chosen path does not
use. Anything else a rule does not own is an error (common.remap).
"""

from __future__ import annotations

from ascend_adapters.common import remap


def glm_dsa_rules(
    num_hidden_layers: int, num_mtp_layers: int, unused_indexer_layers: list[int], dense: bool
) -> list[remap.Rule]:
    rules = [
        remap.skip(r"^rot\.weight$", "MTP-only top-level tensor; the non-MTP model does not own it"),
        remap.skip(r"\.rotary_emb\.inv_freq$", "rotary buffer, recomputed"),
    ]
    if num_mtp_layers > 0:
        ids = "|".join(str(num_hidden_layers + i) for i in range(num_mtp_layers))
        rules.append(remap.skip(rf"^model\.layers\.({ids})\.", "MTP layer (num_nextn_predict_layers); not served"))
    if dense:
        rules.append(
            remap.skip(
                r"^model\.layers\.\d+\.self_attn\.indexer\.",
                "DSA indexer unused on the dense path (every context <= index_topk)",
            )
        )
    elif unused_indexer_layers:
        ids = "|".join(str(i) for i in unused_indexer_layers)
        rules.append(
            remap.skip(
                rf"^model\.layers\.({ids})\.self_attn\.indexer\.",
                "indexer of a 'shared' layer (reuses the previous layer's top-k)",
            )
        )
    return rules
