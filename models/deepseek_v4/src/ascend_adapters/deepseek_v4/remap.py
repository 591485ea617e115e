"""Checkpoint layouts accepted for DeepSeek-V4, as one vLLM ``WeightsMapper`` (``hf_to_vllm_mapper``).

Three layouts reach this model:

1. DeepSeek's native names (also what transformers 5 writes with
   ``save_pretrained``, under a ``model.`` prefix, and what ModelSlim exports
   keep): ``layers.N.attn.wq_a``, ``ffn.experts.E.w1``, ``hc_attn_fn``,
   ``attn_sink``, ``compressor.ape``, ``indexer.compressor.wkv``, ``embed``,
   ``head``, ``hc_head_fn`` ... and the fused ``fused_wqa_wkv``.
2. transformers' internal module names (``self_attn.q_a_proj``,
   ``mlp.experts.gate_up_proj`` stacked, ``compressor.indexer.scorer.weights_proj``).
3. Names of this vLLM model.

The mapper's regex rules apply in order: they first normalise (1) to (2), then
rename (2) to the vLLM model's modules. Shards of a fused module keep their own
names (``q_a_proj``/``kv_proj`` of ``wqkv_a``, ``gate_proj``/``up_proj`` of the
shared expert's ``gate_up_proj``, ``experts.E.gate_proj|up_proj|down_proj`` of
the routed experts): the model's ``load_weights`` stacks them the vLLM way
(``STACKED_PARAMS`` and vLLM's fused-MoE expert mapping), and a ModelSlim
description, renamed by the same mapper through vLLM's ``apply_vllm_mapper``,
finds them through ``packed_modules_mapping``. MTP-only tensors map to ``None``
(skipped on purpose; the model logs them); a name the model does not own is an error.
"""

from __future__ import annotations

import re

from vllm.model_executor.models.utils import WeightsMapper

MTP_REASON = "multi-token-prediction (MTP) layer: not served by DeepseekV4ForCausalLM"
MTP_PATTERN = r"^(model\.)?mtp\."

# A linear's tensors: the weight and, in ModelSlim exports, its quantization companions.
LINEAR_SUFFIX = r"(weight|weight_scale|weight_offset|input_scale|input_offset|deq_scale|quant_bias)"
S = LINEAR_SUFFIX

# DeepSeek native / transformers-saved names -> transformers' internal names.
NATIVE_TO_HF: list[tuple[str, str]] = [
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^(layers\.|norm\.weight$|hc_head)", r"model.\1"),
    (r"^model\.head\.weight$", "lm_head.weight"),
    (r"^model\.embed\.weight$", "model.embed_tokens.weight"),
    (r"\.hc_head_(fn|base|scale)$", r".hc_head.hc_\1"),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.self_attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
    (r"\.self_attn\.indexer\.(wq_b|weights_proj)\.", r".self_attn.compressor.indexer.\1."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"),
    (r"(\.self_attn(?:\.compressor(?:\.indexer)?)?)\.norm\.weight$", r"\1.kv_norm.weight"),
    (r"\.q_norm\.weight$", ".q_a_norm.weight"),
    (r"\.ape$", ".position_bias"),
    (rf"\.wq_a\.{S}$", r".q_a_proj.\1"),
    (rf"\.wq_b\.{S}$", r".q_b_proj.\1"),
    (rf"\.wkv\.{S}$", r".kv_proj.\1"),
    (rf"\.wgate\.{S}$", r".gate_proj.\1"),
    (rf"\.wo_a\.{S}$", r".o_a_proj.\1"),
    (rf"\.wo_b\.{S}$", r".o_b_proj.\1"),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (rf"\.shared_experts\.w1\.{S}$", r".shared_experts.gate_proj.\1"),
    (rf"\.shared_experts\.w3\.{S}$", r".shared_experts.up_proj.\1"),
    (rf"\.shared_experts\.w2\.{S}$", r".shared_experts.down_proj.\1"),
    (rf"\.experts\.(\d+)\.w1\.{S}$", r".experts.\1.gate_proj.\2"),
    (rf"\.experts\.(\d+)\.w3\.{S}$", r".experts.\1.up_proj.\2"),
    (rf"\.experts\.(\d+)\.w2\.{S}$", r".experts.\1.down_proj.\2"),
]

# transformers' internal names -> this vLLM model's modules (renames only; shards keep their names).
HF_TO_VLLM: list[tuple[str, str]] = [
    (rf"\.self_attn\.fused_wqa_wkv\.{S}$", r".self_attn.wqkv_a.\1"),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".compressor.indexer.weights_proj."),
]

# (fused parameter, checkpoint shard, shard id): vLLM's stacked_params_mapping for this model.
STACKED_PARAMS: list[tuple[str, str, int]] = [
    (".self_attn.wqkv_a.", ".self_attn.q_a_proj.", 0),
    (".self_attn.wqkv_a.", ".self_attn.kv_proj.", 1),
    (".shared_experts.gate_up_proj.", ".shared_experts.gate_proj.", 0),
    (".shared_experts.gate_up_proj.", ".shared_experts.up_proj.", 1),
]

# checkpoint names of a routed expert's projections (vLLM's fused-MoE shard ids w1, w2, w3)
EXPERT_GATE, EXPERT_DOWN, EXPERT_UP = "gate_proj", "down_proj", "up_proj"


def mtp_patterns(config=None) -> list[re.Pattern]:
    """MTP tensors: DeepSeek's ``mtp.K.*`` and V3-style extra layers past num_hidden_layers."""
    pats = [re.compile(MTP_PATTERN)]
    extra = int(getattr(config, "num_nextn_predict_layers", 0) or 0) if config is not None else 0
    if extra:
        n = int(config.num_hidden_layers)
        ids = "|".join(str(n + k) for k in range(extra))
        pats.append(re.compile(rf"^(model\.)?layers\.({ids})\."))
    return pats


def weights_mapper(config=None) -> WeightsMapper:
    """The model's ``hf_to_vllm_mapper``; with ``config``, extra MTP layers past the served ones are dropped too.

    The class-level mapper (no config) is what vLLM hands the quantization config; MTP entries of a
    ModelSlim description need no renaming (nothing looks them up).
    """
    skips = {p: None for p in mtp_patterns(config)}
    renames = {re.compile(p): r for p, r in NATIVE_TO_HF + HF_TO_VLLM}
    return WeightsMapper(orig_to_new_regex={**skips, **renames})


def mtp_skip_rules(config) -> dict[str, str]:
    """What the MTP drafter (``mtp.py``) drops: the main model's tensors, and an MTP layer's copies of the
    embedding and head (vLLM's proposer installs the target's)."""
    return {
        r"^(?!(model\.)?mtp\.)": "the target model's tensor; the MTP drafter owns only its MTP layers",
        r"^(model\.)?mtp\.\d+\.(emb|head|embed_tokens|shared_head\.head)\.": (
            "the MTP layer's copy of the embedding or LM head; vLLM's proposer shares the target's"
        ),
    }


def mtp_weights_mapper(config) -> WeightsMapper:
    """DeepSeek's ``mtp.K.*`` -> the drafter's ``model.layers.<num_hidden_layers + K>.*``, then the main
    model's renames (the MTP layer is a decoder layer) and the MTP layer's own: ``norm`` is the shared
    head's norm, ``hc_head_*`` its hyper-connection head."""
    n = int(config.num_hidden_layers)
    layers = {
        re.compile(rf"^(model\.)?mtp\.{k}\."): f"model.layers.{n + k}."
        for k in range(int(getattr(config, "num_nextn_predict_layers", 0) or 0))
    }
    head_norm = {re.compile(r"^(model\.layers\.\d+)\.norm\.weight$"): r"\1.shared_head.norm.weight"}
    renames = {re.compile(p): r for p, r in NATIVE_TO_HF + HF_TO_VLLM}
    return WeightsMapper(orig_to_new_regex={**layers, **head_norm, **renames})
