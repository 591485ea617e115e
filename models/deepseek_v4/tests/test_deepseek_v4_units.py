"""Config acceptance, checkpoint remap and kernel checks (no engine; fast).

Kernels are compared with transformers' own DeepSeek-V4 modules, the independent reference.
"""

from __future__ import annotations

import json

import pytest
import torch
from _dsv4_cases import make_native_hca128

from ascend_adapters.common.remap import RemapError
from ascend_adapters.deepseek_v4 import kernels as K
from ascend_adapters.deepseek_v4.config import load_transformers_config
from ascend_adapters.deepseek_v4.remap import MTP_REASON, build_remapper
from ascend_adapters.deepseek_v4.tiny import build_tiny_model, make_tiny, tiny_config


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv4u")
    tiny = make_tiny(root / "tiny")
    hf128, native = make_native_hca128(root)
    return {"tiny": tiny, "hf128": hf128, "native": native}


def _names(path):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return list(f.keys())


def test_transformers_saved_config_is_read_by_vllm_parser(dirs):
    """vLLM's own get_config (after our register()) returns transformers' class, not vLLM's."""
    from transformers import DeepseekV4Config
    from vllm.transformers_utils.config import get_config

    from ascend_adapters.deepseek_v4 import register

    register()
    cfg = get_config(str(dirs["tiny"]), trust_remote_code=False)
    saved = json.loads((dirs["tiny"] / "config.json").read_text())
    assert isinstance(cfg, DeepseekV4Config)
    assert cfg.layer_types == saved["layer_types"] and cfg.mlp_layer_types == saved["mlp_layer_types"]
    assert cfg.dsv4_rope_parameters == saved["rope_parameters"]
    assert cfg.rope_parameters["rope_type"] == "default"  # what vLLM's own checks see


def test_config_parser_keeps_commons_modelslim_detection():
    """Our ``hf`` parser wraps the one registered before it (common's ModelSlim auto-detection)."""
    from vllm.transformers_utils.config import get_config_parser

    from ascend_adapters.common.quant import register as register_quant
    from ascend_adapters.deepseek_v4 import register

    register_quant()
    register()
    cls = type(get_config_parser("hf"))
    assert getattr(cls, "_ascend_adapters_deepseek_v4", False)
    assert getattr(cls, "_ascend_adapters_modelslim", False)


def test_native_config_matches_transformers_layout(dirs):
    a = load_transformers_config(dirs["hf128"])
    b = load_transformers_config(dirs["native"])
    for key in (
        "layer_types",
        "mlp_layer_types",
        "compress_rates",
        "rope_parameters",
        "qk_rope_head_dim",
        "sliding_window",
        "index_topk",
    ):
        assert getattr(a, key) == getattr(b, key), key


def test_bad_config_names_the_field(tmp_path, dirs):
    cfg = json.loads((dirs["tiny"] / "config.json").read_text())
    cfg["layer_types"][1] = "mystery_attention"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="layer_types"):
        load_transformers_config(tmp_path)


def test_remap_transformers_saved_and_native_names(dirs):
    cfg = load_transformers_config(dirs["tiny"])
    seen = []
    r = build_remapper(cfg, lambda n: seen.append(n) or True)
    for name in _names(dirs["tiny"]):
        new, _ = r.map_name(name)
        assert new is not None
    r.finish()
    mapped = set(r.report.mapped.values())
    assert "model.layers.1.self_attn.compressor.indexer.weights_proj.weight" in mapped
    assert "model.layers.2.self_attn.compressor.position_bias" in mapped
    assert "model.layers.0.mlp.gate.tid2eid" in mapped
    assert "model.layers.1.self_attn.wqkv_a.weight#1" in mapped
    assert "model.layers.3.mlp.experts.routed_experts.w13_weight#expert:7:w3" in mapped
    assert "model.hc_head.hc_fn" in mapped and "lm_head.weight" in mapped

    ncfg = load_transformers_config(dirs["native"])
    r = build_remapper(ncfg, lambda n: True)
    out = {n: r.map_name(n)[0] for n in _names(dirs["native"])}
    r.finish()
    assert set(r.report.skipped) == {"mtp.0.enorm.weight", "mtp.0.e_proj.weight", "mtp.0.attn.wq_a.weight"}
    assert set(r.report.skipped.values()) == {MTP_REASON}
    assert r.report.mapped["layers.0.attn.fused_wqa_wkv.weight"] == "model.layers.0.self_attn.wqkv_a.weight"
    assert r.report.mapped["hc_head_fn"] == "model.hc_head.hc_fn"
    assert r.report.mapped["embed.weight"] == "model.embed_tokens.weight"
    assert None not in {k: v for k, v in out.items() if not k.startswith("mtp.")}.values()


def test_remap_unmapped_native_name_is_an_error(dirs):
    """A native-name tensor that no rule maps to a model parameter stops loading, named."""
    cfg = load_transformers_config(dirs["native"])

    def owned(n):  # what the model owns: everything our rules produce for real names
        return "mystery" not in n and "wq_c" not in n

    r = build_remapper(cfg, owned)
    list(r.apply([("layers.1.attn.wq_c.weight", torch.zeros(1)), ("layers.0.attn_norm.weight", torch.zeros(1))]))
    with pytest.raises(RemapError, match=r"layers\.1\.attn\.wq_c\.weight"):
        r.finish()


def test_kernels_match_transformers_modules():
    model = build_tiny_model(seed=5)
    layer = model.model.layers[1]
    g = torch.Generator().manual_seed(0)
    streams = torch.randn(12, 4, 128, generator=g)
    with torch.no_grad():
        post, comb, col = layer.attn_hc(streams[None])
        p2, c2, col2 = K.hc_pre(
            streams,
            layer.attn_hc.fn,
            layer.attn_hc.base,
            layer.attn_hc.scale,
            sinkhorn_iters=20,
            hc_eps=1e-6,
            norm_eps=1e-6,
        )
        assert torch.allclose(post[0], p2, atol=1e-6) and torch.allclose(comb[0], c2, atol=1e-6)
        assert torch.allclose(col[0], col2, atol=1e-6)
        head = model.model.hc_head(streams[None])[0]
        hh = model.model.hc_head
        assert torch.allclose(
            head, K.hc_head(streams, hh.hc_fn, hh.hc_base, hh.hc_scale, hc_eps=1e-6, norm_eps=1e-6), atol=1e-6
        )
        x = torch.randn(1, 12, 128, generator=g)
        mlp = layer.mlp
        ref = mlp(x)[0] - mlp.shared_experts(x[0])
        logits = torch.nn.functional.linear(x[0], mlp.gate.weight)
        w, ids = K.route(
            logits, top_k=2, scoring="sqrtsoftplus", scaling=1.5, normalize=True, bias=mlp.gate.e_score_correction_bias
        )
        got = K.moe_experts(x[0], w, ids, mlp.experts.gate_up_proj, mlp.experts.down_proj, model.config.swiglu_limit)
        assert torch.allclose(ref, got, atol=1e-5)


def test_yarn_rope_matches_transformers():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    cfg = tiny_config()
    rot = DeepseekV4RotaryEmbedding(cfg)
    for label in ("main", "compress"):
        inv, scale = K.rope_inv_freq(cfg.rope_parameters[label], cfg.head_dim, cfg.max_position_embeddings)
        assert torch.allclose(inv, getattr(rot, f"{label}_inv_freq"), rtol=1e-6)
        assert scale == getattr(rot, f"{label}_attention_scaling")


def test_startup_policy_wraps_vllms_hook():
    """register() keeps vLLM's own hook for the architecture and adds state sizing, then our checks."""
    from vllm.model_executor.models import config as vllm_models_config

    from ascend_adapters.deepseek_v4 import ARCH, register
    from ascend_adapters.deepseek_v4.policy import check_startup

    register()
    register()
    cls = vllm_models_config.MODELS_CONFIG_MAP[ARCH]
    assert issubclass(cls, vllm_models_config.DeepseekV4ForCausalLMConfig)
    assert issubclass(cls, vllm_models_config.MambaModelConfig)
    assert cls.__mro__[1] is vllm_models_config.DeepseekV4ForCausalLMConfig  # installed once
    assert cls._ascend_adapters_policy.endswith(check_startup.__qualname__)


def test_compressed_switch_reads_common_flags(monkeypatch):
    from ascend_adapters.common.flags import FlagError
    from ascend_adapters.deepseek_v4.config import COMPRESSED_ENV, compressed_enabled

    monkeypatch.delenv(COMPRESSED_ENV, raising=False)
    assert compressed_enabled()
    monkeypatch.setenv(COMPRESSED_ENV, "off")
    assert not compressed_enabled()
    monkeypatch.setenv(COMPRESSED_ENV, "window")  # was silently "on"
    with pytest.raises(FlagError, match=COMPRESSED_ENV):
        compressed_enabled()


def test_release_quantization_config_is_read_or_refused_naming_the_field():
    from ascend_adapters.deepseek_v4.config import release_quant

    q = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    assert release_quant({"quantization_config": q}, "cfg") == {"weight_block_size": [128, 128]}
    assert release_quant({"quantization_config": {"quant_method": "modelslim"}}, "cfg") is None
    with pytest.raises(ValueError, match=r"quantization_config\.fmt='e5m2'"):
        release_quant({"quantization_config": {**q, "fmt": "e5m2"}}, "cfg")


def test_release_weight_without_scale_is_named():
    from ascend_adapters.deepseek_v4.dequant import dequantize_release

    w = torch.zeros(4, 8).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_a\.weight: .* without its layers\.0\.attn\.wq_a\.scale"):
        list(dequantize_release([("layers.0.attn.wq_a.weight", w)], (128, 128)))
    s = torch.ones(1, 1).to(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wkv\.scale: no layers\.0\.attn\.wkv\.weight"):
        list(dequantize_release([("layers.0.attn.wkv.scale", s)], (128, 128)))
