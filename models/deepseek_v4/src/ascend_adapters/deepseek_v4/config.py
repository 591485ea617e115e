"""Config acceptance for DeepSeek-V4 on the portable path.

vLLM 0.32 maps ``model_type: deepseek_v4`` to its own config class, which
rejects configs saved by transformers (``mlp_layer_types``) before any plugin
model is chosen. We register, through vLLM's public config-parser registry, an
``hf`` parser that builds transformers' ``DeepseekV4Config`` for that model
type only. transformers' class reads both layouts: its own
(``layer_types``/``compress_rates``/``mlp_layer_types``/nested
``rope_parameters``) and DeepSeek's native one (``compress_ratios``,
``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``). Every other
model type goes to vLLM's stock ``HFConfigParser`` untouched.
The start-up checks (what the portable model refuses) are in ``policy.py``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ascend_adapters.common.flags import env_flag

logger = logging.getLogger("ascend_adapters")

MODEL_TYPE = "deepseek_v4"
ARCH = "DeepseekV4ForCausalLM"
# Set to 0 to serve the sliding-window branch only (then max_model_len must fit the window).
COMPRESSED_ENV = "ASCEND_ADAPTERS_DSV4_COMPRESSED"

LAYER_SLIDING = "sliding_attention"
LAYER_CSA = "compressed_sparse_attention"
LAYER_HCA = "heavily_compressed_attention"
SUPPORTED_ROPE_TYPES = ("default", "yarn")
# The MTP layer's attention and MoE type: DeepSeek's config lists its compress ratio after the main
# layers' (0: sliding window); its MoE routes by score (hash routing is for the first layers only).
MTP_LAYER_TYPE, MTP_MLP_TYPE = LAYER_SLIDING, "moe"


def compressed_enabled() -> bool:
    return env_flag(COMPRESSED_ENV, default=True)


def _read_config_dict(model) -> dict | None:
    path = Path(str(model)) / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def load_transformers_config(model, config_dict: dict | None = None, **kwargs):
    """transformers' DeepseekV4Config for a checkpoint directory (either key layout)."""
    from transformers import DeepseekV4Config

    if config_dict is None:
        config_dict = _read_config_dict(model)
        if config_dict is None:
            raise FileNotFoundError(f"{model}: no readable config.json")
    data = dict(config_dict)
    # DeepSeek's native files carry rope settings as `rope_scaling` (YaRN for the
    # compressed branches) and sometimes a per-layer list that includes MTP layers.
    if "rope_scaling" in data and "rope_parameters" not in data:
        rs = dict(data.pop("rope_scaling") or {})
        if "type" in rs and "rope_type" not in rs:
            rs["rope_type"] = rs.pop("type")
        data["rope_parameters"] = rs
    for key in ("compress_ratios",):
        if key in data and "num_hidden_layers" in data:
            data[key] = list(data[key])[: data["num_hidden_layers"]]
    try:
        config = DeepseekV4Config.from_dict(data, name_or_path=str(model))
    except Exception as exc:
        raise ValueError(f"{model}/config.json: not a valid DeepSeek-V4 config ({type(exc).__name__}: {exc})") from exc
    validate_config(config, source=f"{model}/config.json")
    return config


def rope_sets(config) -> dict:
    """The per-branch rope parameter sets ``{"main": ..., "compress": ...}``."""
    nested = getattr(config, "dsv4_rope_parameters", None)
    return nested if nested is not None else (config.rope_parameters or {})


def vllm_rope_parameters(config, label: str, source: str = "config") -> dict:
    """One rope set as ``rope_parameters`` for vLLM's DeepSeek-V4 rotary class (``get_rope``).

    That class (``DeepseekV4ScalingRotaryEmbedding``) rotates the trailing ``rope_dim`` channels
    with interleaved (GPT-J) pairs from a float32 cos/sin table, the way transformers' deepseek_v4
    does. Its table is YaRN's; the two rope types map onto it exactly:

    * ``default``: factor 1 makes YaRN's two frequency sets the same, and equal betas make the
      blend weights exactly 0 or 1, so each frequency is the plain ``1/theta^(2i/d)`` bit for bit;
    * ``yarn``: the same ``factor``/``beta_*``/``original_max_position_embeddings``; transformers'
      ``attention_factor`` becomes vLLM's mscale ratio (``mscale``/``mscale_all_dim``). vLLM 0.32
      has no free scale and always truncates the correction range, so an ``attention_factor``
      other than 1.0 or the derived one, and ``truncate: false``, are refused.
    """
    params = rope_sets(config).get(label) or {}
    where = f"{source}: rope_parameters.{label}"
    rope_type = params.get("rope_type", "default")
    if "rope_theta" not in params:
        raise ValueError(f"{where}.rope_theta is missing")
    out = {
        "rope_type": "deepseek_yarn",
        "is_deepseek_v4": True,
        "rope_theta": params["rope_theta"],
        "rope_dim": int(config.head_dim * params.get("partial_rotary_factor", 1.0)),
        "mscale": 0,
        "mscale_all_dim": 0,
    }
    if rope_type == "default":
        return {
            **out,
            "factor": 1.0,
            "original_max_position_embeddings": config.max_position_embeddings,
            "beta_fast": 1,
            "beta_slow": 1,
        }
    if rope_type != "yarn":
        raise ValueError(
            f"{where}.rope_type={rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if params.get("truncate", True) is False:
        raise ValueError(f"{where}.truncate=false is not supported (vLLM's YaRN table truncates the correction range)")
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    out.update(
        factor=factor if factor is not None else config.max_position_embeddings / original,
        original_max_position_embeddings=original,
        beta_fast=params.get("beta_fast") or 32,
        beta_slow=params.get("beta_slow") or 1,
    )
    attention_factor = params.get("attention_factor")
    if attention_factor is None:  # transformers derives it: mscale ratio, else 0.1*ln(factor)+1
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        both = bool(mscale and mscale_all_dim)
        out.update(mscale=mscale if both else 1, mscale_all_dim=mscale_all_dim if both else 0)
    elif attention_factor != 1.0:
        raise ValueError(
            f"{where}.attention_factor={attention_factor} is not supported: served are 1.0 (transformers' "
            "DeepSeek-V4 default) or none (derived from factor, mscale and mscale_all_dim)"
        )
    return out


def flatten_rope_for_vllm(config):
    """Keep the nested ``main``/``compress`` sets aside for the model and leave vLLM a flat one.

    vLLM's max-length and rope checks only understand a flat dict or one nested by
    layer type; DeepSeek-V4 nests by branch. The sliding branch's (``main``) set is
    what vLLM sees; the model reads ``dsv4_rope_parameters``.
    """
    rp = config.rope_parameters or {}
    if isinstance(rp.get("main"), dict):
        config.dsv4_rope_parameters = {k: dict(v) for k, v in rp.items() if isinstance(v, dict)}
        config.rope_parameters = dict(rp["main"])
    return config


def validate_config(config, source: str = "config") -> None:
    """Fail closed on settings the portable model does not implement."""
    bad_layers = [t for t in config.layer_types if t not in (LAYER_SLIDING, LAYER_CSA, LAYER_HCA)]
    if bad_layers:
        raise ValueError(f"{source}: unknown layer_types {bad_layers}")
    for label in ("main", "compress"):
        vllm_rope_parameters(config, label, source)
    if config.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
        raise ValueError(f"{source}: scoring_func={config.scoring_func!r} is not supported")
    if config.num_key_value_heads != 1:
        raise ValueError(f"{source}: num_key_value_heads={config.num_key_value_heads}; DeepSeek-V4 shares one KV head")
    if (config.num_attention_heads * config.head_dim) % config.o_groups:
        raise ValueError(f"{source}: num_attention_heads*head_dim is not divisible by o_groups={config.o_groups}")


def max_exact_len(config) -> int | None:
    """Longest context served exactly, or None when unbounded (compressed branches on).

    With the compressed branches off, a CSA/HCA layer attends to its window only. That equals the
    checkpoint's model only while no compressed entry exists yet: a query at position t sees entry
    w once t + 1 >= (w + 1) * rate, so the first entry joins at position rate - 1. Window-only is
    therefore exact up to min(sliding_window, smallest compress rate - 1) tokens, not up to the
    window (which is what an adapter that drops the compressor weights silently assumes).
    """
    types = {t for t in config.layer_types if t != LAYER_SLIDING}
    if compressed_enabled() or not types:
        return None
    rates = [int(config.compress_rates[t]) for t in types]
    return min(int(config.sliding_window), min(rates) - 1)


RELEASE_QUANT_ATTR = "dsv4_release_quant"


def release_quant(config_dict: dict, source: str) -> dict | None:
    """DeepSeek's release format (``quant_method: fp8``, FP8 e4m3 block + FP4 experts), or None.

    Returns ``{"weight_block_size": [b0, b1]}``; the model dequantizes those weights at load
    (``dequant.py``), so vLLM must not see the quantization config. Any other fp8 variant is refused.
    """
    q = config_dict.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        return None
    checks = {"fmt": ("e4m3", None), "scale_fmt": ("ue8m0", None), "activation_scheme": ("dynamic", None)}
    for key, allowed in checks.items():
        if q.get(key) not in allowed:
            raise ValueError(
                f"{source}: quantization_config.{key}={q.get(key)!r} is not supported for DeepSeek-V4 "
                f"(the release uses {allowed[0]!r})"
            )
    block = q.get("weight_block_size") or [128, 128]
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{source}: quantization_config.weight_block_size={block!r} is not two positive integers")
    return {"weight_block_size": list(block)}


def _modelslim_marker(model, config_dict: dict) -> dict | None:
    """common's ModelSlim auto-detection rule, when common's quant layer is installed."""
    try:
        from ascend_adapters.common.quant.detect import modelslim_marker
    except ImportError:
        return None
    return modelslim_marker(model, config_dict)


def _parser_class(base):
    class DeepseekV4AwareHFConfigParser(base):
        """The registered ``hf`` parser, except that ``deepseek_v4`` is read with transformers' class."""

        _ascend_adapters_deepseek_v4 = True

        def parse(self, model, trust_remote_code, revision=None, code_revision=None, **kwargs):
            config_dict = _read_config_dict(model)
            if not config_dict or config_dict.get("model_type") != MODEL_TYPE:
                return super().parse(model, trust_remote_code, revision=revision, code_revision=code_revision, **kwargs)
            hf_overrides = kwargs.pop("hf_overrides", None)
            config = flatten_rope_for_vllm(load_transformers_config(model, config_dict))
            if isinstance(hf_overrides, dict) and hf_overrides:
                config.update(hf_overrides)
            elif callable(hf_overrides):
                config = hf_overrides(config)
            release = release_quant(config_dict, f"{model}/config.json")
            if release is not None:
                # served in the serving dtype: weights are dequantized at load, vLLM sees no quantization
                config_dict = {k: v for k, v in config_dict.items() if k != "quantization_config"}
                if hasattr(config, "quantization_config"):
                    del config.quantization_config
                setattr(config, RELEASE_QUANT_ATTR, release)
            marker = _modelslim_marker(model, config_dict)
            if marker is not None:
                config_dict = {**config_dict, "quantization_config": marker}
            return config_dict, config

    return DeepseekV4AwareHFConfigParser


_REGISTERED = False


def register_config() -> None:
    """Wrap the registered ``hf`` config parser (idempotent).

    Wrapping (not replacing) keeps any parser registered before ours (e.g. common's
    ModelSlim auto-detection); a parser registered after ours that subclasses it keeps
    ours, which the class attribute check below recognises.
    """
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm.transformers_utils.config import get_config_parser, register_config_parser

    base = type(get_config_parser("hf"))
    if not getattr(base, "_ascend_adapters_deepseek_v4", False):
        vlog = logging.getLogger("vllm.transformers_utils.config")
        old = vlog.level
        vlog.setLevel(logging.ERROR)  # replacing the default parser is the intent
        try:
            register_config_parser("hf")(_parser_class(base))
        finally:
            vlog.setLevel(old)
    _REGISTERED = True
