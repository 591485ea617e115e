"""Checkpoint layouts accepted for DeepSeek-V4, as declarative rules for common/remap.

Three layouts reach this model:

1. DeepSeek's native names (also what transformers 5 writes with
   ``save_pretrained``, under a ``model.`` prefix, and what ModelSlim exports
   keep): ``layers.N.attn.wq_a``, ``ffn.experts.E.w1``, ``hc_attn_fn``,
   ``attn_sink``, ``compressor.ape``, ``indexer.compressor.wkv``, ``embed``,
   ``head``, ``hc_head_fn`` ... and the fused ``fused_wqa_wkv``.
2. transformers' internal module names (``self_attn.q_a_proj``,
   ``mlp.experts.gate_up_proj`` stacked, ``compressor.indexer.scorer.weights_proj``).
3. Names of this vLLM model (stage 2 of the chain below).

The chain first normalises (1) to (2), then maps (2) to the vLLM model's
parameters. Fused targets carry a shard suffix ``#k`` (``wqkv_a`` = wq_a rows
then wkv rows; shared-expert ``gate_up_proj`` = w1 then w3) and routed experts
``#expert:E:w1|w3|w2`` (vLLM's fused-MoE shard ids; ``E`` = ``all`` for a stacked tensor). MTP-only tensors are skipped on purpose and
reported; any other name no rule maps is an error.
"""

from __future__ import annotations

from collections.abc import Callable

from ascend_adapters.common.remap import Remapper, rename, skip

MTP_REASON = "multi-token-prediction (MTP) layer: not served by DeepseekV4ForCausalLM"

# A linear's tensors: the weight and, in ModelSlim exports, its quantization companions.
LINEAR_SUFFIX = r"(weight|weight_scale|weight_offset|input_scale|input_offset|deq_scale|quant_bias)"
S = LINEAR_SUFFIX


def native_to_hf_rules() -> list:
    """DeepSeek native / transformers-saved names -> transformers' internal names."""
    return [
        rename(r"^embed\.weight$", "model.embed_tokens.weight"),
        rename(r"^head\.weight$", "lm_head.weight"),
        rename(r"^(layers\.|norm\.weight$|hc_head)", r"model.\1"),
        rename(r"^model\.head\.weight$", "lm_head.weight"),
        rename(r"^model\.embed\.weight$", "model.embed_tokens.weight"),
        rename(r"\.hc_head_(fn|base|scale)$", r".hc_head.hc_\1"),
        rename(r"\.attn\.", ".self_attn."),
        rename(r"\.ffn\.", ".mlp."),
        rename(r"\.self_attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
        rename(r"\.self_attn\.indexer\.(wq_b|weights_proj)\.", r".self_attn.compressor.indexer.\1."),
        rename(r"\.attn_norm\.", ".input_layernorm."),
        rename(r"\.ffn_norm\.", ".post_attention_layernorm."),
        rename(r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
        rename(r"\.attn_sink$", ".sinks"),
        rename(r"(\.self_attn(?:\.compressor(?:\.indexer)?)?)\.norm\.weight$", r"\1.kv_norm.weight"),
        rename(r"\.q_norm\.weight$", ".q_a_norm.weight"),
        rename(r"\.ape$", ".position_bias"),
        rename(rf"\.wq_a\.{S}$", r".q_a_proj.\1"),
        rename(rf"\.wq_b\.{S}$", r".q_b_proj.\1"),
        rename(rf"\.wkv\.{S}$", r".kv_proj.\1"),
        rename(rf"\.wgate\.{S}$", r".gate_proj.\1"),
        rename(rf"\.wo_a\.{S}$", r".o_a_proj.\1"),
        rename(rf"\.wo_b\.{S}$", r".o_b_proj.\1"),
        rename(r"\.gate\.bias$", ".gate.e_score_correction_bias"),
        rename(rf"\.shared_experts\.w1\.{S}$", r".shared_experts.gate_proj.\1"),
        rename(rf"\.shared_experts\.w3\.{S}$", r".shared_experts.up_proj.\1"),
        rename(rf"\.shared_experts\.w2\.{S}$", r".shared_experts.down_proj.\1"),
        rename(rf"\.experts\.(\d+)\.w1\.{S}$", r".experts.\1.gate_proj.\2"),
        rename(rf"\.experts\.(\d+)\.w3\.{S}$", r".experts.\1.up_proj.\2"),
        rename(rf"\.experts\.(\d+)\.w2\.{S}$", r".experts.\1.down_proj.\2"),
    ]


def hf_to_vllm_rules() -> list:
    """transformers' internal names -> this vLLM model's parameters."""
    return [
        rename(rf"\.self_attn\.q_a_proj\.{S}$", r".self_attn.wqkv_a.\1#0"),
        rename(rf"\.self_attn\.kv_proj\.{S}$", r".self_attn.wqkv_a.\1#1"),
        rename(rf"\.self_attn\.fused_wqa_wkv\.{S}$", r".self_attn.wqkv_a.\1"),
        rename(r"\.compressor\.indexer\.scorer\.weights_proj\.", ".compressor.indexer.weights_proj."),
        rename(rf"\.shared_experts\.gate_proj\.{S}$", r".shared_experts.gate_up_proj.\1#0"),
        rename(rf"\.shared_experts\.up_proj\.{S}$", r".shared_experts.gate_up_proj.\1#1"),
        rename(
            r"\.experts\.(\d+)\.gate_proj\.(weight|weight_scale|weight_offset)$",
            r".experts.routed_experts.w13_\2#expert:\1:w1",
        ),
        rename(
            r"\.experts\.(\d+)\.up_proj\.(weight|weight_scale|weight_offset)$",
            r".experts.routed_experts.w13_\2#expert:\1:w3",
        ),
        rename(
            r"\.experts\.(\d+)\.down_proj\.(weight|weight_scale|weight_offset)$",
            r".experts.routed_experts.w2_\2#expert:\1:w2",
        ),
        rename(r"\.experts\.gate_up_proj$", ".experts.routed_experts.w13_weight#expert:all:w13"),
        rename(r"\.experts\.down_proj$", ".experts.routed_experts.w2_weight#expert:all:w2"),
    ]


def mtp_skip_rules(config) -> list:
    """MTP tensors: DeepSeek's ``mtp.K.*`` and V3-style extra layers past num_hidden_layers."""
    rules = [skip(r"^(model\.)?mtp\.", MTP_REASON)]
    n = int(config.num_hidden_layers)
    extra = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if extra:
        ids = "|".join(str(n + k) for k in range(extra))
        rules.append(skip(rf"^(model\.)?layers\.({ids})\.", MTP_REASON))
    return rules


def build_remapper(
    config, owned: Callable[[str], bool] | None = None, source: str = "DeepSeek-V4 checkpoint"
) -> Remapper:
    return Remapper(mtp_skip_rules(config) + native_to_hf_rules() + hf_to_vllm_rules(), targets=owned, source=source)


def description_renamer(config):
    """``fn(description key) -> key`` in transformers' internal module names (None: unchanged).

    ModelSlim descriptions use the checkpoint's (native) names; common's ``ModelSlimConfig`` looks
    layers up by module prefix, and this model's fused modules list their transformers-internal
    shard names in ``packed_modules_mapping``.
    """
    rem = Remapper(mtp_skip_rules(config) + native_to_hf_rules(), targets=None, source="ModelSlim description")

    def fn(key: str) -> str | None:
        new, _ = rem.map_name(key)
        return new

    return fn
