"""Config acceptance, checkpoint names and weight loading, kernel checks (no engine start; fast).

Kernels are compared with transformers' own DeepSeek-V4 modules, the independent reference. Weight
loading runs on the vLLM model built in this process (vLLM's ``initialize_model``, single-rank gloo
group), through its ``load_weights`` (vLLM's ``AutoWeightsLoader`` and layer loaders).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from _dsv4_cases import make_native_hca128

from ascend_adapters.common import dispatch
from ascend_adapters.deepseek_v4 import kernels as K
from ascend_adapters.deepseek_v4.config import load_transformers_config
from ascend_adapters.deepseek_v4.remap import MTP_REASON, weights_mapper
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


def test_mapper_transformers_saved_and_native_names(dirs):
    """Every checkpoint name maps to this model's names; fused shards keep theirs; MTP maps to None."""
    from ascend_adapters.common.compat import weights_mapper_fn

    m = weights_mapper_fn(weights_mapper(load_transformers_config(dirs["tiny"])))
    mapped = {m(n) for n in _names(dirs["tiny"])}
    assert None not in mapped
    assert "model.layers.1.self_attn.compressor.indexer.weights_proj.weight" in mapped
    assert "model.layers.2.self_attn.compressor.position_bias" in mapped
    assert "model.layers.0.mlp.gate.tid2eid" in mapped
    assert "model.layers.1.self_attn.kv_proj.weight" in mapped  # a shard of wqkv_a, stacked on load
    assert "model.layers.3.mlp.experts.7.up_proj.weight" in mapped  # routed expert, vLLM's expert mapping
    assert "model.hc_head.hc_fn" in mapped and "lm_head.weight" in mapped

    m = weights_mapper_fn(weights_mapper(load_transformers_config(dirs["native"])))
    out = {n: m(n) for n in _names(dirs["native"])}
    assert {n for n, v in out.items() if v is None} == {
        "mtp.0.enorm.weight",
        "mtp.0.e_proj.weight",
        "mtp.0.attn.wq_a.weight",
    }
    assert out["layers.0.attn.fused_wqa_wkv.weight"] == "model.layers.0.self_attn.wqkv_a.weight"
    assert out["hc_head_fn"] == "model.hc_head.hc_fn"
    assert out["embed.weight"] == "model.embed_tokens.weight"
    # V3-style MTP layers past num_hidden_layers (config.num_nextn_predict_layers = 1)
    assert m("layers.4.attn.wq_a.weight") is None and m("model.layers.4.ffn.gate.weight") is None


def test_modelslim_description_renamed_through_vllms_mapper_hook():
    """vLLM's configure_quant_config hands the class mapper to the quant config (apply_vllm_mapper):
    native description keys become the module names the layers ask for; MTP entries stay as they are."""
    from vllm.model_executor.model_loader.utils import configure_quant_config

    from ascend_adapters.common.quant.config import ModelSlimConfig
    from ascend_adapters.common.quant.description import Description
    from ascend_adapters.deepseek_v4.model import DeepseekV4ForCausalLM

    qc = ModelSlimConfig(
        Description.from_dict(
            {
                "model.layers.0.attn.wq_b.weight": "W8A8_DYNAMIC",
                "layers.1.attn.wq_a.weight": "W8A8_DYNAMIC",
                "model.layers.2.ffn.experts.5.w3.weight": "W8A8_DYNAMIC",
                "model.layers.3.ffn.shared_experts.w1.weight": "FLOAT",
                "mtp.0.attn.wq_a.weight": "W8A8_DYNAMIC",
            }
        )
    )
    configure_quant_config(qc, DeepseekV4ForCausalLM)
    q = qc.description.quantized_weights()
    assert {k: v for k, v in q.items() if not k.startswith("mtp.")} == {
        "model.layers.0.self_attn.q_b_proj": "W8A8_DYNAMIC",
        "model.layers.1.self_attn.q_a_proj": "W8A8_DYNAMIC",
        "model.layers.2.mlp.experts.5.up_proj": "W8A8_DYNAMIC",
    }
    # MTP entries: kept (0.27/0.28 hand the mapper with its drops) or renamed (0.32 drops the drops)
    assert [k for k in q if k.startswith("mtp.")] in (["mtp.0.attn.wq_a"], ["mtp.0.self_attn.q_a_proj"])
    assert qc.shard_prefixes("model.layers.1.self_attn.wqkv_a") == [
        "model.layers.1.self_attn.q_a_proj",
        "model.layers.1.self_attn.kv_proj",
    ]
    assert qc.description.layer_type("model.layers.3.mlp.shared_experts.gate_proj") == "FLOAT"


# -- weight loading on the vLLM model built in this process ----------------------------------------
@pytest.fixture(scope="module")
def vllm_model(dirs):
    """``build(model_dir)`` -> a fresh DeepseekV4ForCausalLM built by vLLM (nothing loaded yet)."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    from ascend_adapters.deepseek_v4 import register
    from ascend_adapters.testing.inprocess import ensure_single_rank_parallel_state

    register()

    def build(model_dir):
        mc = ModelConfig(model=str(model_dir), dtype="float32", max_model_len=256, skip_tokenizer_init=True)
        cfg = VllmConfig(model_config=mc, cache_config=CacheConfig(enable_prefix_caching=False))
        with set_current_vllm_config(cfg):
            ensure_single_rank_parallel_state()
            return initialize_model(cfg)

    return build


def test_attention_caches_are_kv_cache_specs_per_layer_type(dirs, vllm_model):
    """Each attention layer declares only the caches its type needs, each a vLLM KV-cache spec whose block
    spans 128 positions (full caches) or a divisor of 128 (sliding caches, all of one page size): prefix hits
    every 128 tokens; the backend asks for a block-outermost layout (vLLM 0.32 packs the unequal pages into
    one block id in it) and declares graphs of uniform batches (decodes, MTP verifications:
    test_deepseek_v4_graph.py replays them)."""
    import importlib.util

    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    from ascend_adapters.deepseek_v4.config import LAYER_CSA, LAYER_HCA, LAYER_SLIDING

    cfg = tiny_config()
    rates, w = cfg.compress_rates, cfg.sliding_window
    # kind -> (sliding window, positions per row) by layer type; None: the cache keeps every row
    expected = {
        LAYER_SLIDING: {"window": (w, 1)},
        LAYER_CSA: {
            "window": (w, 1),
            "state": (2 * rates[LAYER_CSA], 1),
            "index_state": (2 * rates[LAYER_CSA], 1),
            "entries": (None, rates[LAYER_CSA]),
            "index": (None, rates[LAYER_CSA]),
        },
        # an HCA layer's state: its window's running summary, read at the position before a step
        LAYER_HCA: {"window": (w, 1), "state": (2, 1), "entries": (None, rates[LAYER_HCA])},
    }
    model = vllm_model(dirs["tiny"])
    sliding_pages = set()
    for i, layer in enumerate(model.model.layers):
        caches = layer.self_attn.caches
        want = expected[cfg.layer_types[i]]
        assert set(caches) == set(want), (i, sorted(caches))
        for kind, cache in caches.items():
            spec = cache.get_kv_cache_spec(None)
            window, per_row = want[kind]
            if window is None:
                assert type(spec) is MLAAttentionSpec, (i, kind)
                ratio = getattr(spec, "tokens_per_state", getattr(spec, "compress_ratio", None))
                assert ratio == per_row and spec.block_size == 128, (i, kind, ratio, spec.block_size)
            else:
                assert type(spec) is SlidingWindowMLASpec and spec.sliding_window == window, (i, kind)
                assert 128 % spec.block_size == 0, (i, kind, spec.block_size)
                if cache.geometry.float32:  # an HCA summary: float32 whatever the model dtype
                    assert spec.dtype == torch.float32 and kind == "state", (i, kind)
                else:
                    sliding_pages.add(spec.page_size_bytes)
            backend = cache.get_attn_backend()
            assert backend.get_builder_cls().get_cudagraph_support(None, None) is AttentionCGSupport.UNIFORM_BATCH
            layouts = backend.supported_kv_cache_layouts()  # None only where the engine has no layouts (0.27/0.28)
            assert (layouts is None) == (importlib.util.find_spec("vllm.v1.kv_cache_layout") is None)
            assert layouts is None or {layout.name for layout in layouts} == {"BLHNC", "BLNHC"}, layouts
    assert len(sliding_pages) == 1, sliding_pages


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _state(model) -> dict:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def test_load_stacks_shards_and_experts_the_vllm_way(dirs, vllm_model):
    t = _tensors(dirs["tiny"])
    model = vllm_model(dirs["tiny"])
    loaded = model.load_weights(iter(t.items()))
    assert {n for n, _ in model.named_parameters()} <= loaded
    layer = model.model.layers[1]
    assert torch.equal(
        layer.self_attn.wqkv_a.weight,
        torch.cat([t["model.layers.1.attn.wq_a.weight"], t["model.layers.1.attn.wkv.weight"]]),
    )
    assert torch.equal(
        layer.mlp.shared_experts.gate_up_proj.weight,
        torch.cat([t["model.layers.1.ffn.shared_experts.w1.weight"], t["model.layers.1.ffn.shared_experts.w3.weight"]]),
    )
    routed = model.model.layers[3].mlp.experts.routed_experts
    w1, w3 = t["model.layers.3.ffn.experts.7.w1.weight"], t["model.layers.3.ffn.experts.7.w3.weight"]
    assert torch.equal(routed.w13_weight[7], torch.cat([w1, w3]))
    assert torch.equal(routed.w2_weight[7], t["model.layers.3.ffn.experts.7.w2.weight"])
    assert torch.equal(model.model.layers[0].mlp.gate.tid2eid, t["model.layers.0.ffn.gate.tid2eid"])  # a buffer
    assert torch.equal(layer.self_attn.compressor.position_bias, t["model.layers.1.attn.compressor.ape"])


def test_transformers_internal_names_load_the_same_weights(dirs, vllm_model):
    """transformers' in-memory names (q_a_proj, stacked experts.gate_up_proj [E, 2I, H] ...) and the
    saved native names give the same model, tensor for tensor."""
    from _dsv4_cases import hf_model

    saved = vllm_model(dirs["tiny"])
    saved.load_weights(iter(_tensors(dirs["tiny"]).items()))
    internal_sd = hf_model(dirs["tiny"]).state_dict()
    assert "model.layers.3.mlp.experts.gate_up_proj" in internal_sd  # the stacked layout is exercised
    internal = vllm_model(dirs["tiny"])
    internal.load_weights(iter(internal_sd.items()))
    a, b = _state(saved), _state(internal)
    assert a.keys() == b.keys()
    assert [n for n in a if not torch.equal(a[n], b[n])] == []


def test_native_layout_skips_mtp_on_purpose_and_says_so(dirs, vllm_model, caplog):
    import logging

    t = _tensors(dirs["native"])
    model = vllm_model(dirs["native"])
    with caplog.at_level(logging.INFO, logger="ascend_adapters"):
        model.load_weights(iter(t.items()))
    assert "skipped 3 checkpoint tensor(s) on purpose" in caplog.text and MTP_REASON in caplog.text
    assert "mtp.0.e_proj.weight" in caplog.text
    assert torch.equal(model.model.layers[0].self_attn.wqkv_a.weight, t["layers.0.attn.fused_wqa_wkv.weight"])


@pytest.mark.parametrize(
    "extra",
    ["layers.1.attn.wq_c.weight", "layers.0.attn.wq_b.bias", "mystery.weight", "layers.2.ffn.experts.9.w1.weight"],
)
def test_unknown_tensor_is_an_error_naming_it(dirs, vllm_model, extra):
    t = _tensors(dirs["native"])
    t[extra] = torch.zeros(4, 4)
    with pytest.raises(ValueError, match=rf"checkpoint tensor {re.escape(extra)} \(4, 4\): "):
        vllm_model(dirs["native"]).load_weights(iter(t.items()))


@pytest.mark.parametrize(
    "drop, target",
    [
        ("layers.0.ffn.gate.tid2eid", "model.layers.0.mlp.gate.tid2eid"),
        ("layers.2.attn.wo_b.weight", "model.layers.2.self_attn.o_b_proj.weight"),
    ],
)
def test_missing_tensor_is_an_error_naming_it(dirs, vllm_model, drop, target):
    t = _tensors(dirs["native"])
    del t[drop]
    with pytest.raises(ValueError, match=rf"lacks 1 tensor\(s\) the model needs: \['{re.escape(target)}'\]"):
        vllm_model(dirs["native"]).load_weights(iter(t.items()))


@pytest.mark.parametrize(
    "name", ["head.weight", "layers.1.hc_attn_fn", "layers.0.ffn.gate.tid2eid", "layers.1.attn.wkv.weight"]
)
def test_shape_mismatch_names_the_checkpoint_tensor(dirs, vllm_model, name):
    t = _tensors(dirs["native"])
    t[name] = t[name][:-1]
    with pytest.raises(ValueError, match=rf"checkpoint tensor {re.escape(name)} \("):
        vllm_model(dirs["native"]).load_weights(iter(t.items()))


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
        got = dispatch.op("common.swiglu_experts")(
            x[0], mlp.experts.gate_up_proj, mlp.experts.down_proj, w, ids, limit=model.config.swiglu_limit
        )
        assert torch.allclose(ref, got, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_summaries_continue_across_steps_and_close_as_the_whole_window(dtype):
    """``dsv4.window_summaries`` (an HCA compressor's running summary): positions 0..40 of a request at rate 8,
    brought in steps of 1, 5, 13 and 22 tokens (a step continuing the summary cached at its first position's
    predecessor, as the attention does), beside a second request's padded row: every valid cell's pooling is
    the softmax-gated pooling of its window's positions up to it and its log-denominator their logsumexp, both
    computed whole here in float64 (transformers' HCA pooling, ``softmax(gate) * kv`` summed over the window,
    at a window's last position). Bound: float32 sums of at most 8 terms, ``1e-5`` relative on these O(1)
    values; bfloat16 inputs are read exactly (the kernel works in float32)."""
    rate, c, n = 8, 6, 41
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(n, c, generator=g).to(dtype)
    gate = (4 * torch.randn(n, c, generator=g)).to(dtype)
    got, prev = [], torch.full((2, 2 * c), float("nan"))
    for a, b in ((0, 1), (1, 6), (6, 19), (19, 41)):
        width = b - a
        pos = torch.arange(a, a + 22)[None].expand(2, -1)  # a grid of 22 columns: the request, then padding
        valid = torch.zeros(2, 22, dtype=torch.bool)
        valid[0, :width] = True
        kv_cells, gate_cells = (
            torch.cat([t[a:b], t[:1].expand(22 - width, -1)])[None].expand(2, -1, -1) for t in (kv, gate)
        )
        carried = torch.tensor([a % rate != 0, True])
        out = K.window_summaries(kv_cells, gate_cells, pos // rate, valid, carried, prev)
        assert out.dtype == torch.float32 and out.shape == (2, 22, 2 * c)
        got.append(out[0, :width])
        prev = out[:, width - 1]
    got = torch.cat(got)
    for p in range(n):
        w0 = p // rate * rate
        weights = gate[w0 : p + 1].double().softmax(dim=0)
        pooled = (weights * kv[w0 : p + 1].double()).sum(0)
        lse = torch.logsumexp(gate[w0 : p + 1].double(), dim=0)
        assert torch.allclose(got[p, :c].double(), pooled, rtol=1e-5, atol=1e-5), p
        assert torch.allclose(got[p, c:].double(), lse, rtol=1e-5, atol=1e-5), p
    assert torch.isfinite(got).all()


def _long_yarn_config():
    """A shape like DeepSeek-V4-Flash's rope: head_dim 512 with a 64-channel rope, YaRN factor 16 on
    the compress set (a shorter context than the real 1M, to keep the tables small)."""
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        head_dim=512,
        partial_rotary_factor=64 / 512,
        max_position_embeddings=65536,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096},
    )


@pytest.mark.parametrize("config_fn", [tiny_config, _long_yarn_config], ids=["tiny", "long_yarn"])
def test_vllm_rotary_matches_transformers_bit_for_bit(config_fn):
    """vLLM's DeepSeek-V4 rotary class (as ``deepseek_v4_rope`` builds it) against transformers'
    DeepseekV4RotaryEmbedding + apply_rotary_pos_emb, float32: equal tables, equal rotation (forward
    and inverse) on the trailing rope channels, for the plain (main) and the YaRN (compress) set."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding, apply_rotary_pos_emb
    from vllm.config import VllmConfig, set_current_vllm_config

    from ascend_adapters.deepseek_v4.rope import apply_rope, deepseek_v4_rope

    cfg = config_fn()
    assert {cfg.rope_parameters[label]["rope_type"] for label in ("main", "compress")} == {"default", "yarn"}
    ref = DeepseekV4RotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(3)
    n = cfg.max_position_embeddings
    positions = torch.cat([torch.arange(64), torch.randint(0, n, (64,), generator=g), torch.tensor([n - 1])])
    x = torch.randn(positions.numel(), 3, cfg.head_dim, generator=g)
    with set_current_vllm_config(VllmConfig()):
        for label in ("main", "compress"):
            rope = deepseek_v4_rope(cfg, label, n)
            cos, sin = ref(x, positions[None], layer_type=label)
            table = rope.cos_sin_cache[positions]
            assert table.dtype == torch.float32
            assert torch.equal(table, torch.cat([cos[0], sin[0]], dim=-1)), label
            assert torch.equal(apply_rope(rope, positions, x), apply_rotary_pos_emb(x, cos[0], sin[0])), label
            inv = apply_rope(rope, positions, x, inverse=True)
            assert torch.equal(inv, apply_rotary_pos_emb(x, cos[0], -sin[0])), label
            one_head = apply_rope(rope, positions, x[:, 0])  # [T, D]: the shared K=V head, the compressed entries
            assert torch.equal(one_head, apply_rotary_pos_emb(x[:, :1], cos[0], sin[0])[:, 0]), label


@pytest.mark.parametrize(
    "extra, named",
    [({"attention_factor": 0.7}, "rope_parameters.compress.attention_factor"), ({"truncate": False}, "truncate")],
)
def test_rope_set_vllm_cannot_express_is_refused_naming_it(dirs, tmp_path, extra, named):
    cfg = json.loads((dirs["tiny"] / "config.json").read_text())
    cfg["rope_parameters"]["compress"].update(extra)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=re.escape(named)):
        load_transformers_config(tmp_path)


def test_startup_policy_wraps_vllms_hook():
    """register() keeps vLLM's own hook for the architecture and adds state sizing, then our checks."""
    from vllm.model_executor.models import config as vllm_models_config

    from ascend_adapters.deepseek_v4 import ARCH, register
    from ascend_adapters.deepseek_v4.policy import check_startup

    register()
    register()
    cls = vllm_models_config.MODELS_CONFIG_MAP[ARCH]
    assert issubclass(cls, vllm_models_config.DeepseekV4ForCausalLMConfig)
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


def test_release_dequantization_equals_hand_computed_values():
    """Bytes decoded by hand from DeepSeek's published rules (docs/references.md#deepseek-v4-fp8-fp4): e4m3 is
    sign | 4 exponent bits (bias 7) | 3 mantissa bits, subnormal below exponent 1; e8m0 is 2**(byte - 127);
    e2m1 is sign | 2 exponent bits (bias 1) | 1 mantissa bit, two per byte, low nibble first."""
    from ascend_adapters.deepseek_v4.dequant import dequant_fp4, dequant_fp8_block

    def bytes_as(values, dtype, shape):
        return torch.tensor(values, dtype=torch.uint8).reshape(shape).view(dtype)

    # e4m3: 0x38 = 2^0 * 1.0; 0x3C = 1.5; 0x40 = 2.0; 0x7E = 2^8 * 1.75 = 448 (the largest); 0x01 = 2^-6 * 1/8
    # (subnormal); 0xB8 = -1.0; 0x00 = 0
    codes = [0x38, 0x3C, 0x40, 0x7E, 0x01, 0xB8, 0x00]
    want = [1.0, 1.5, 2.0, 448.0, 2.0**-9, -1.0, 0.0]
    # 130 x 130 weight: 2 x 2 blocks of 128 (the last ragged); scales 2^0, 2^1 / 2^-2, 2^3
    w = torch.full((130, 130), 0x38, dtype=torch.uint8)
    w[0, :7] = torch.tensor(codes, dtype=torch.uint8)
    scale = bytes_as([127, 128, 125, 130], torch.float8_e8m0fnu, (2, 2))
    got = dequant_fp8_block(w.view(torch.float8_e4m3fn), scale, (128, 128), "t")
    assert got[0, :7].tolist() == want
    assert [got[0, 127].item(), got[0, 128].item(), got[129, 0].item(), got[129, 129].item()] == [1.0, 2.0, 0.25, 8.0]

    # e2m1 codes: 1 = 0.5, 2 = 1.0, 7 = 2^2 * 1.5 = 6, 15 = -6, 8 = -0, 9 = -0.5, 4 = 2.0, 5 = 3.0
    # bytes 0x21 -> (0.5, 1.0), 0xF7 -> (6, -6), 0x98 -> (-0, -0.5), 0x54 -> (2, 3); 64 inputs = 2 scale groups
    row = [0x21, 0xF7, 0x98, 0x54] + [0x22] * 28
    packed = torch.tensor([row, row], dtype=torch.uint8).view(torch.int8)  # [2, 32] -> [2, 64] values
    scale = bytes_as([127, 129, 126, 127], torch.float8_e8m0fnu, (2, 2))  # row 0: 1, 4; row 1: 0.5, 1
    got = dequant_fp4(packed, scale, "t")
    assert got[0, :8].tolist() == [0.5, 1.0, 6.0, -6.0, -0.0, -0.5, 2.0, 3.0]
    assert got[1, :8].tolist() == [0.25, 0.5, 3.0, -3.0, -0.0, -0.25, 1.0, 1.5]
    assert got[0, 32:34].tolist() == [4.0, 4.0] and got[1, 32:34].tolist() == [1.0, 1.0]  # 0x22 = (1, 1)


def test_release_weight_without_scale_is_named():
    from ascend_adapters.deepseek_v4.dequant import dequantize_release

    w = torch.zeros(4, 8).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_a\.weight: .* without its layers\.0\.attn\.wq_a\.scale"):
        list(dequantize_release([("layers.0.attn.wq_a.weight", w)], (128, 128)))
    s = torch.ones(1, 1).to(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wkv\.scale: no layers\.0\.attn\.wkv\.weight"):
        list(dequantize_release([("layers.0.attn.wkv.scale", s)], (128, 128)))


# One expert's down projection, or one shard of a fused projection, missing from the checkpoint: vLLM
# counts a fused parameter as loaded once any shard of it is, so only the common loader's per-shard,
# per-expert accounting can refuse these (named as the model's shard).
DAMAGE = {
    "tiny": [
        ("model.layers.3.ffn.experts.5.w2.weight", "model.layers.3.mlp.experts.5.down_proj.weight"),
        ("model.layers.1.attn.wkv.weight", "model.layers.1.self_attn.kv_proj.weight"),
        ("model.layers.1.ffn.shared_experts.w3.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"),
    ],
    "native": [
        ("layers.3.ffn.experts.5.w2.weight", "model.layers.3.mlp.experts.5.down_proj.weight"),
        ("layers.2.attn.wkv.weight", "model.layers.2.self_attn.kv_proj.weight"),
        ("layers.2.ffn.shared_experts.w1.weight", "model.layers.2.mlp.shared_experts.gate_proj.weight"),
    ],
}


@pytest.mark.parametrize("layout, drop, named", [(k, d, n) for k, v in DAMAGE.items() for d, n in v])
def test_checkpoint_missing_an_expert_or_a_shard_is_refused_naming_it(dirs, vllm_model, layout, drop, named):
    t = _tensors(dirs[layout])
    del t[drop]
    with pytest.raises(ValueError, match=rf"lacks 1 tensor\(s\) the model needs: \['{re.escape(named)}'\]"):
        vllm_model(dirs[layout]).load_weights(iter(t.items()))


@pytest.fixture(scope="module")
def quantized_dirs(tmp_path_factory):
    """The ModelSlim W8A8_DYNAMIC export (native names) and DeepSeek's FP8/FP4 release of the tiny model."""
    from _dsv4_cases import W8A8_PLAN

    from ascend_adapters.deepseek_v4.tiny import native_name, write_release
    from ascend_adapters.testing.modelslim import export_w8a8

    root = tmp_path_factory.mktemp("dsv4q")
    float_dir = make_tiny(
        root / "tiny", seed=2, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    )
    w8a8 = export_w8a8(float_dir, root / "w8a8", W8A8_PLAN, transform=lambda n, t: [(native_name(n), t)])
    return {"w8a8": w8a8, "release": write_release(float_dir, root / "release")}


def _engine_built(model_dir):
    """The model vLLM builds for ``model_dir`` (quantization detected as at serve time), nothing loaded."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from ascend_adapters.testing.inprocess import ensure_single_rank_parallel_state

    cfg = EngineArgs(
        model=str(model_dir), dtype="float32", max_model_len=256, skip_tokenizer_init=True
    ).create_engine_config()
    with set_current_vllm_config(cfg), set_default_torch_dtype(torch.float32):
        ensure_single_rank_parallel_state()
        return initialize_model(vllm_config=cfg, model_config=cfg.model_config)


# (layout, checkpoint tensors dropped, the model's name the refusal carries); a quantized tensor goes
# with its companions (weight_scale/weight_offset; the release's block .scale)
QUANTIZED_DAMAGE = [
    ("w8a8", "layers.2.ffn.experts.5.w2.", "model.layers.2.mlp.experts.5.down_proj.weight"),
    ("w8a8", "layers.1.attn.wkv.", "model.layers.1.self_attn.kv_proj.weight"),
    ("release", "layers.3.ffn.experts.5.w2.", "model.layers.3.mlp.experts.5.down_proj.weight"),
    ("release", "layers.1.attn.wkv.", "model.layers.1.self_attn.kv_proj.weight"),
]


@pytest.mark.parametrize("layout, drop, named", QUANTIZED_DAMAGE)
def test_quantized_checkpoint_missing_an_expert_or_a_shard_is_refused_naming_it(quantized_dirs, layout, drop, named):
    from ascend_adapters.testing.modelslim import load_export

    t = load_export(quantized_dirs[layout])[0] if layout == "w8a8" else _tensors(quantized_dirs[layout])
    kept = {n: v for n, v in t.items() if not n.startswith(drop)}
    assert len(kept) < len(t)
    with pytest.raises(ValueError, match=rf"lacks \d+ tensor\(s\) the model needs: \['{re.escape(named)}'"):
        _engine_built(quantized_dirs[layout]).load_weights(iter(kept.items()))
