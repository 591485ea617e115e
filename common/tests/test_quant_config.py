"""ModelSlim description checks and the `modelslim` vLLM quant methods inside real vLLM layers.

vLLM's parallel layers are built in this process (single-rank gloo group) and loaded through
vLLM's own weight loaders, so fused q/k/v and gate/up shards, deq_scale encodings and the
fused-MoE loader are exercised as in a served model.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from ascend_adapters.common.quant.description import (  # noqa: E402
    Description,
    DescriptionError,
    check_export,
    weight_files,
)

# -- description ----------------------------------------------------------------------------------


def test_metadata_keys_are_not_tensors():
    d = Description.from_dict({
        "model.layers.0.mlp.down_proj.weight": "W8A8_DYNAMIC",
        "model.layers.0.mlp.down_proj.weight_scale": "W8A8_DYNAMIC",
        "lm_head.weight": "FLOAT", "version": "1.0.0", "model_quant_type": "W8A8_DYNAMIC",
        "metadata": {}, "group_size": 0, "optional": {},
    })  # fmt: skip
    assert set(d.types) == {
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.mlp.down_proj.weight_scale",
        "lm_head.weight",
    }
    assert d.model_quant_type == "W8A8_DYNAMIC"
    assert d.layer_type("model.layers.0.mlp.down_proj") == "W8A8_DYNAMIC"
    assert d.layer_type("model.layers.9.mtp.proj") == "FLOAT"  # missing layers are FLOAT


@pytest.mark.parametrize(
    "kind, words", [("W8A8_WHATEVER", "unknown quantization type"), ("W4A8_DYNAMIC", "does not support")]
)
def test_bad_type_strings_name_the_tensor(kind, words):
    with pytest.raises(DescriptionError, match=rf"model\.layers\.3\.self_attn\.o_proj\.weight.*{words}"):
        Description.from_dict({"model.layers.3.self_attn.o_proj.weight": kind})


def test_quantized_kv_cache_is_refused():
    with pytest.raises(DescriptionError, match="kv_cache_type"):
        Description.from_dict({"kv_cache_type": "C8", "a.weight": "FLOAT"})


def test_fused_shard_type_mismatch_names_the_tensors():
    d = Description.from_dict(
        {"l.q_proj.weight": "W8A8_DYNAMIC", "l.k_proj.weight": "W8A8_DYNAMIC", "l.v_proj.weight": "FLOAT"}
    )
    with pytest.raises(DescriptionError, match=r"'l\.qkv_proj'.*l\.v_proj\.weight=FLOAT"):
        d.fused_type("l.qkv_proj", ["l.q_proj", "l.k_proj", "l.v_proj"])


def _write_export(tmp_path, tensors: dict, desc: dict, name="quant_model_weights-00001-of-00001.safetensors"):
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / name))
    (tmp_path / "quant_model_description.json").write_text(json.dumps(desc))
    return tmp_path


def _dyn_layer(prefix, n=8, k=16):
    return {
        f"{prefix}.weight": torch.zeros(n, k, dtype=torch.int8),
        f"{prefix}.weight_scale": torch.ones(n, 1),
        f"{prefix}.weight_offset": torch.zeros(n, 1),
    }


def test_check_export_accepts_both_file_names(tmp_path):
    t = _dyn_layer("m.l")
    desc = {k: "W8A8_DYNAMIC" for k in t}
    a = tmp_path / "a"
    a.mkdir()
    check_export(_write_export(a, t, desc))
    b = tmp_path / "b"
    b.mkdir()
    _write_export(b, t, desc, name="quant_model_weight_w8a8.safetensors")
    check_export(b)
    assert [f.name for f in weight_files(b)] == ["quant_model_weight_w8a8.safetensors"]


def test_export_headers_are_read_by_admissions_capped_reader(tmp_path, monkeypatch):
    """The quant checks read safetensors headers with admission's one reader: its size cap and checks apply."""
    import struct

    from ascend_adapters.common.admission import safetensors_header

    t = _dyn_layer("m.l")
    _write_export(tmp_path, t, {k: "W8A8_DYNAMIC" for k in t})
    check_export(tmp_path)
    (st,) = weight_files(tmp_path)
    (n,) = struct.unpack("<Q", st.read_bytes()[:8])
    # the cap is a module constant read at call time; one byte below this header's length must refuse it
    monkeypatch.setattr(safetensors_header, "MAX_HEADER_BYTES", n - 1)
    with pytest.raises(DescriptionError, match=rf"{st.name}: header length {n} exceeds the {n - 1}-byte limit"):
        check_export(tmp_path)
    monkeypatch.undo()
    raw = st.read_bytes()
    st.write_bytes(raw[:-1])  # data buffer one byte short: the header promises more than the file holds
    with pytest.raises(DescriptionError, match=rf"{st.name}: tensors need \d+ data bytes, the file holds"):
        check_export(tmp_path)


def test_missing_companion_is_a_startup_error_naming_it(tmp_path):
    t = _dyn_layer("model.layers.0.mlp.up_proj")
    del t["model.layers.0.mlp.up_proj.weight_scale"]
    _write_export(tmp_path, t, {"model.layers.0.mlp.up_proj.weight": "W8A8_DYNAMIC"})
    with pytest.raises(DescriptionError, match=r"model\.layers\.0\.mlp\.up_proj\.weight_scale: missing companion"):
        check_export(tmp_path)


def test_static_companions_and_undeclared_int8(tmp_path):
    t = {"s.weight": torch.zeros(4, 8, dtype=torch.int8), "s.input_scale": torch.ones(1),
         "s.input_offset": torch.zeros(1), "s.deq_scale": torch.ones(4, dtype=torch.int64),
         "s.quant_bias": torch.zeros(4), "x.weight": torch.zeros(4, 8, dtype=torch.int8)}  # fmt: skip
    _write_export(tmp_path, t, {"s.weight": "W8A8"})
    with pytest.raises(DescriptionError) as err:
        check_export(tmp_path)
    msg = str(err.value)
    assert "s.quant_bias: dtype F32 not allowed" in msg
    assert "x.weight: int8 tensor not listed" in msg


# -- real vLLM layers ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_env():
    """Single-rank vLLM distributed state and a current VllmConfig for building layers in-process."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from ascend_adapters.common.quant import register
    from ascend_adapters.testing.inprocess import ensure_single_rank_parallel_state

    register()
    cfg = VllmConfig()
    with set_current_vllm_config(cfg):
        ensure_single_rank_parallel_state()
        yield cfg


def _config(types: dict, packed=None):
    from ascend_adapters.common.quant.config import ModelSlimConfig

    qc = ModelSlimConfig(Description.from_dict(types))
    qc.packed_modules_mapping.update(packed or {})
    return qc


def _load(layer, name, tensor, shard=None):
    param = getattr(layer, name)
    if shard is None:
        param.weight_loader(param, tensor)
    else:
        param.weight_loader(param, tensor, shard)


def _finish(layer):
    layer.quant_method.process_weights_after_loading(layer)


def _qkv(qc, prefix="m.l.qkv_proj"):
    from vllm.model_executor.layers.linear import QKVParallelLinear

    return QKVParallelLinear(64, 32, 2, 1, bias=False, quant_config=qc, prefix=prefix, params_dtype=torch.float32)


def test_fused_qkv_type_mismatch_fails_at_layer_build(vllm_env):
    qc = _config(
        {"m.l.q_proj.weight": "W8A8", "m.l.k_proj.weight": "W8A8", "m.l.v_proj.weight": "W8A8_DYNAMIC"},
        {"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
    )
    with pytest.raises(DescriptionError, match=r"m\.l\.v_proj\.weight=W8A8_DYNAMIC"):
        _qkv(qc)


def test_dynamic_qkv_loads_shards_and_matches_reference(vllm_env):
    from ascend_adapters.testing.modelslim import ReferenceLinear

    qc = _config(
        {f"m.l.{p}.weight": "W8A8_DYNAMIC" for p in ("q_proj", "k_proj", "v_proj")},
        {"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
    )
    layer = _qkv(qc)
    g = torch.Generator().manual_seed(0)
    tensors, desc = {}, {}
    for shard, n in (("q", 64), ("k", 32), ("v", 32)):
        w = torch.randint(-127, 128, (n, 64), generator=g, dtype=torch.int8)
        s = torch.rand(n, 1, generator=g) * 1e-2
        _load(layer, "weight", w, shard)
        _load(layer, "weight_scale", s, shard)
        _load(layer, "weight_offset", torch.zeros(n, 1), shard)
        tensors |= {f"{shard}.weight": w, f"{shard}.weight_scale": s}
        desc[f"{shard}.weight"] = "W8A8_DYNAMIC"
    _finish(layer)
    x = torch.randn(5, 64, generator=g)
    y = layer(x)[0]
    ref = torch.cat([ReferenceLinear(tensors, desc, s)(x) for s in "qkv"], dim=-1)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("deq_dtype", ["int64", "float32"])
def test_static_gate_up_loads_both_deq_encodings(vllm_env, deq_dtype):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    from ascend_adapters.common.quant.linear import encode_deq_scale
    from ascend_adapters.testing.modelslim import ReferenceLinear

    qc = _config(
        {"m.mlp.gate_proj.weight": "W8A8", "m.mlp.up_proj.weight": "W8A8"}, {"gate_up_proj": ["gate_proj", "up_proj"]}
    )
    layer = MergedColumnParallelLinear(
        48, [40, 40], bias=False, quant_config=qc, prefix="m.mlp.gate_up_proj", params_dtype=torch.float32
    )
    g = torch.Generator().manual_seed(1)
    tensors, desc = {}, {}
    for shard, name in ((0, "gate"), (1, "up")):
        w = torch.randint(-127, 128, (40, 48), generator=g, dtype=torch.int8)
        deq = torch.rand(40, generator=g) * 1e-4
        t = {
            "weight": w,
            "input_scale": torch.tensor([0.03]),
            "input_offset": torch.tensor([4.0]),
            "deq_scale": encode_deq_scale(deq) if deq_dtype == "int64" else deq,
            "quant_bias": torch.randint(-900, 900, (40,), generator=g, dtype=torch.int32),
        }
        for k, v in t.items():
            _load(layer, k, v, shard)
            tensors[f"{name}.{k}"] = v
        desc[f"{name}.weight"] = "W8A8"
    _finish(layer)
    assert layer.deq_scale.dtype == torch.float32
    x = torch.randn(6, 48, generator=g)
    y = layer(x)[0]
    ref = torch.cat([ReferenceLinear(tensors, desc, s)(x) for s in ("gate", "up")], dim=-1)
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)


def test_static_fused_shards_with_different_input_scales_are_refused(vllm_env):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    qc = _config({"m.gate_proj.weight": "W8A8", "m.up_proj.weight": "W8A8"}, {"gate_up_proj": ["gate_proj", "up_proj"]})
    layer = MergedColumnParallelLinear(
        16, [8, 8], bias=False, quant_config=qc, prefix="m.gate_up_proj", params_dtype=torch.float32
    )
    for shard, sc in ((0, 0.1), (1, 0.2)):
        _load(layer, "input_scale", torch.tensor([sc]), shard)
        _load(layer, "input_offset", torch.tensor([0.0]), shard)
    with pytest.raises(DescriptionError, match=r"m\.gate_up_proj\.input_scale: the fused shards have different"):
        _finish(layer)


def test_wrong_dtype_is_an_error_naming_the_tensor(vllm_env):
    from vllm.model_executor.layers.linear import RowParallelLinear

    qc = _config({"m.o_proj.weight": "W8A8_DYNAMIC", "m.down_proj.weight": "FLOAT"})
    layer = RowParallelLinear(16, 8, bias=False, quant_config=qc, prefix="m.o_proj", params_dtype=torch.float32)
    with pytest.raises(
        DescriptionError,
        match=r"m\.o_proj\.weight: checkpoint tensor has dtype torch\.float32.*"
        r"W8A8_DYNAMIC",
    ):
        _load(layer, "weight", torch.zeros(8, 16))
    flt = RowParallelLinear(16, 8, bias=False, quant_config=qc, prefix="m.down_proj", params_dtype=torch.float32)
    with pytest.raises(DescriptionError, match=r"m\.down_proj\.weight: .*torch\.int8.*FLOAT"):
        _load(flt, "weight", torch.zeros(8, 16, dtype=torch.int8))


def test_row_parallel_static_adds_quant_bias_on_rank0_only(vllm_env):
    from vllm.model_executor.layers.linear import RowParallelLinear

    qc = _config({"m.o_proj.weight": "W8A8"})
    layers = []
    for rank in (0, 1):
        layer = RowParallelLinear(16, 8, bias=False, quant_config=qc, prefix="m.o_proj", params_dtype=torch.float32)
        for k, v in {
            "weight": torch.ones(8, 16, dtype=torch.int8),
            "input_scale": torch.tensor([1.0]),
            "input_offset": torch.tensor([0.0]),
            "deq_scale": torch.ones(8),
            "quant_bias": torch.full((8,), 100, dtype=torch.int32),
        }.items():
            _load(layer, k, v)
        layer.tp_rank = rank  # what a second tensor-parallel rank sees
        _finish(layer)
        layers.append(layer)
    x = torch.zeros(1, 16)
    assert layers[0](x)[0].tolist() == [[100.0] * 8]
    assert layers[1](x)[0].tolist() == [[0.0] * 8]


def test_lm_head_must_be_float(vllm_env):
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    with pytest.raises(DescriptionError, match=r"lm_head\.weight.*only FLOAT"):
        ParallelLMHead(64, 16, quant_config=_config({"lm_head.weight": "W8A8_DYNAMIC"}), prefix="lm_head")


# -- fused MoE ------------------------------------------------------------------------------------


def _moe_layer(qc, e=8, h=64, i=32, top_k=2, params_dtype=torch.float32):
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory

    get_current_vllm_config().compilation_config.static_forward_context.pop("m.mlp.experts", None)
    return FusedMoEFactory(
        num_experts=e,
        top_k=top_k,
        hidden_size=h,
        intermediate_size=i,
        quant_config=qc,
        prefix="m.mlp.experts",
        params_dtype=params_dtype,
    )


def test_moe_experts_with_mixed_types_are_refused(vllm_env):
    types = {
        f"m.mlp.experts.{e}.{p}.weight": "W8A8_DYNAMIC" for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")
    }
    types["m.mlp.experts.5.down_proj.weight"] = "FLOAT"
    with pytest.raises(DescriptionError, match=r"experts of 'm\.mlp\.experts' have different quantization types"):
        _moe_layer(_config(types))


def test_moe_layer_loads_per_expert_checkpoint_and_matches_loop(vllm_env):
    from ascend_adapters.common.quant.moe import ModelSlimW8A8DynamicMoEMethod
    from ascend_adapters.testing.modelslim import quantize_weight_per_channel

    e, h, i = 8, 64, 32
    types = {
        f"m.mlp.experts.{x}.{p}.weight": "W8A8_DYNAMIC" for x in range(e) for p in ("gate_proj", "up_proj", "down_proj")
    }
    runner = _moe_layer(_config(types), e, h, i)
    experts = runner.routed_experts
    assert isinstance(experts.quant_method, ModelSlimW8A8DynamicMoEMethod)
    g = torch.Generator().manual_seed(3)
    ckpt, float_w = [], {}
    for x in range(e):
        for p, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            q, s = quantize_weight_per_channel(torch.randn(*shape, generator=g) * 0.05)
            ckpt += [
                (f"{x}.{p}.weight", q),
                (f"{x}.{p}.weight_scale", s),
                (f"{x}.{p}.weight_offset", torch.zeros_like(s)),
            ]
            float_w[(x, p)] = (q, s)
    loaded = set(experts.load_weights(ckpt))
    assert {"w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"} <= loaded
    experts.quant_method.process_weights_after_loading(experts)
    t = 9
    xs = torch.randn(t, h, generator=g)
    ids = torch.randint(0, 3, (t, 2), generator=g)  # experts 3..7 get no tokens
    ids[:, 1] = (ids[:, 0] + 1) % 3
    ids[4, 1] = -1  # a masked route
    topk_w = torch.rand(t, 2, generator=g)
    # the method's own entry with the routes given (vLLM 0.27/0.28 route inside it: forward_modular refuses there)
    y = experts.quant_method.apply(experts, xs, topk_w, ids.to(torch.int32), None, None)

    def dyn(v, q, s):
        sc = v.abs().amax(-1, keepdim=True) / 127.0
        vq = torch.round(v / sc)
        return (vq.double() @ q.double().t()) * (sc.double() * s.double().reshape(1, -1))

    ref = torch.zeros(t, h, dtype=torch.float64)
    for tok in range(t):
        for j in range(2):
            x_id = int(ids[tok, j])
            if x_id < 0:
                continue
            gate = dyn(xs[tok : tok + 1], *float_w[(x_id, "gate_proj")]).float()
            up = dyn(xs[tok : tok + 1], *float_w[(x_id, "up_proj")]).float()
            a = torch.nn.functional.silu(gate) * up
            ref[tok] += dyn(a, *float_w[(x_id, "down_proj")])[0] * float(topk_w[tok, j])
    assert (y.double() - ref).abs().max() <= 2e-3 * ref.abs().max()


def test_moe_float_expert_weight_is_refused(vllm_env):
    types = {
        f"m.mlp.experts.{x}.{p}.weight": "W8A8_DYNAMIC" for x in range(8) for p in ("gate_proj", "up_proj", "down_proj")
    }
    experts = _moe_layer(_config(types)).routed_experts
    with pytest.raises(DescriptionError, match=r"m\.mlp\.experts\.2\.up_proj\.weight: .*torch\.float32"):
        list(experts.load_weights([("2.up_proj.weight", torch.zeros(32, 64))]))


# -- auto-selection -------------------------------------------------------------------------------


def test_autoselect_marker_only_for_modelslim_dirs(tmp_path, monkeypatch):
    from ascend_adapters.common.quant.detect import AUTO_ENV, modelslim_marker

    assert modelslim_marker(tmp_path, {}) is None
    (tmp_path / "quant_model_description.json").write_text("{}")
    assert modelslim_marker(tmp_path, {})["quant_method"] == "modelslim"
    assert modelslim_marker(tmp_path, {"quantization_config": {"quant_method": "fp8"}}) is None
    assert modelslim_marker("org/some-hub-name", {}) is None
    monkeypatch.setenv(AUTO_ENV, "0")
    assert modelslim_marker(tmp_path, {}) is None


def test_from_config_accepts_description_and_marker(tmp_path):
    from ascend_adapters.common.quant.config import ModelSlimConfig

    cfg = ModelSlimConfig.from_config({"a.b.weight": "W8A8_DYNAMIC", "version": "1.0.0"})
    assert cfg.description.layer_type("a.b") == "W8A8_DYNAMIC"
    marker = ModelSlimConfig.from_config({"quant_method": "modelslim", "model_dir": str(tmp_path)})
    assert marker.description is None
    with pytest.raises(DescriptionError, match="quant_model_description.json"):
        marker.maybe_update_config(str(tmp_path))


# -- our exporter ---------------------------------------------------------------------------------


def _float_src(tmp_path):
    from ascend_adapters.testing.factory import make_checkpoint

    g = torch.Generator().manual_seed(11)
    tensors = {"model.norm.weight": torch.ones(32), "lm_head.weight": torch.randn(40, 32, generator=g)}
    for e in range(3):
        for p, shape in (("gate_proj", (16, 32)), ("up_proj", (16, 32)), ("down_proj", (32, 16))):
            tensors[f"model.layers.0.mlp.experts.{e}.{p}.weight"] = torch.randn(*shape, generator=g) * 0.05
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.randn(32, 32, generator=g) * 0.05
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.randn(32, generator=g) * 0.1
    return make_checkpoint(tmp_path / "src", {"architectures": ["X"], "vocab_size": 40}, tensors, tokenizer=False)


@pytest.mark.parametrize("style, deq", [("new", "int64"), ("old", "float32")])
def test_export_w8a8_layout_and_math(tmp_path, style, deq):
    from ascend_adapters.testing.modelslim import (
        ReferenceLinear,
        effective_float_weight,
        export_w8a8,
        load_export,
    )

    src = _float_src(tmp_path)
    plan = {"model.layers.*.mlp.experts.*": "W8A8_DYNAMIC", "model.layers.0.self_attn.o_proj": "W8A8"}
    out = export_w8a8(
        src,
        tmp_path / "out",
        plan,
        input_ranges={"model.layers.0.self_attn.o_proj": (-1.5, 2.0)},
        style=style,
        deq_scale_dtype=deq,
        max_shard_bytes=4096 if style == "old" else None,
    )
    check_export(out)  # the description and the files agree (companions, dtypes)
    names = sorted(f.name for f in weight_files(out))
    if style == "new":
        assert names == ["quant_model_weights-00001-of-00001.safetensors"]
        assert (out / "quant_model_weights.safetensors.index.json").exists()
    else:
        assert len(names) > 1 and all(n.startswith("quant_model_weight_w8a8-") for n in names)
    tensors, desc = load_export(out)
    assert desc["model_quant_type"] == "W8A8_MIX" and desc["lm_head.weight"] == "FLOAT"
    e2 = "model.layers.0.mlp.experts.2.down_proj"
    assert tensors[e2 + ".weight"].dtype == torch.int8 and tensors[e2 + ".weight_scale"].shape == (32, 1)
    assert not tensors[e2 + ".weight_offset"].any()
    o = "model.layers.0.self_attn.o_proj"
    assert tensors[o + ".deq_scale"].dtype == (torch.int64 if deq == "int64" else torch.float32)
    assert tensors[o + ".quant_bias"].dtype == torch.int32 and desc[o + ".bias"] == "W8A8"
    # The exported layers approximate the float ones (per-channel int8 weights, int8 activations).
    from safetensors.torch import load_file

    src_t = load_file(str(src / "model.safetensors"))
    for prefix in (e2, o):
        wf = src_t[prefix + ".weight"]
        assert (effective_float_weight(tensors, desc, prefix) - wf).abs().max() <= wf.abs().max() / 127
    x = torch.rand(4, 32) * 3.5 - 1.5
    y = ReferenceLinear(tensors, desc, o)(x)
    ref = x @ src_t[o + ".weight"].t() + src_t[o + ".bias"]
    assert (y - ref).abs().max() < 0.05 * ref.abs().max()


def test_export_w8a8_static_needs_input_ranges(tmp_path):
    from ascend_adapters.testing.modelslim import export_w8a8

    with pytest.raises(ValueError, match=r"o_proj: static W8A8 needs its input range"):
        export_w8a8(_float_src(tmp_path), tmp_path / "out", {"model.layers.0.self_attn.o_proj": "W8A8"})


@pytest.mark.parametrize("kind", ["W8A8_DYNAMIC", "W8A8"])
def test_replicated_linear_uses_the_v1_loader(vllm_env, kind):
    """ReplicatedLinear (used by MLA / DSA projections) loads through vLLM's plain weight loader."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    from ascend_adapters.testing.modelslim import ReferenceLinear

    qc = _config({"m.wq_a.weight": kind})
    layer = ReplicatedLinear(32, 24, bias=False, quant_config=qc, prefix="m.wq_a", params_dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    t = {"weight": torch.randint(-127, 128, (24, 32), generator=g, dtype=torch.int8)}
    if kind == "W8A8_DYNAMIC":
        t |= {"weight_scale": torch.rand(24, 1, generator=g) * 1e-2, "weight_offset": torch.zeros(24, 1)}
    else:
        t |= {
            "input_scale": torch.tensor([0.05]),
            "input_offset": torch.tensor([-3.0]),
            "deq_scale": torch.rand(24, generator=g) * 1e-3,
            "quant_bias": torch.randint(-99, 99, (24,), generator=g, dtype=torch.int32),
        }
    for k, v in t.items():
        _load(layer, k, v)
    _finish(layer)
    x = torch.randn(3, 32, generator=g)
    ref = ReferenceLinear({f"l.{k}": v for k, v in t.items()}, {"l.weight": kind}, "l")(x)
    torch.testing.assert_close(layer(x)[0], ref, rtol=1e-6, atol=1e-6)


def test_split_fused_experts_and_record_input_ranges():
    from ascend_adapters.testing.modelslim import record_input_ranges, split_fused_experts

    g = torch.Generator().manual_seed(9)
    gate_up, down = torch.randn(3, 8, 4, generator=g), torch.randn(3, 4, 4, generator=g)
    out = dict(split_fused_experts("m.experts.gate_up_proj", gate_up))
    out |= dict(split_fused_experts("m.experts.down_proj", down))
    out |= dict(split_fused_experts("m.norm.weight", torch.ones(4)))
    assert torch.equal(out["m.experts.2.gate_proj.weight"], gate_up[2, :4])
    assert torch.equal(out["m.experts.2.up_proj.weight"], gate_up[2, 4:])
    assert torch.equal(out["m.experts.1.down_proj.weight"], down[1]) and "m.norm.weight" in out

    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    xs = [torch.randn(5, 4, generator=g) for _ in range(3)]
    r = record_input_ranges(model, xs)
    assert r["0"] == (min(float(x.min()) for x in xs), max(float(x.max()) for x in xs))
    assert r["2"][0] >= 0  # after ReLU
    assert set(record_input_ranges(model, xs, ["2"])) == {"2"}


# -- the NPU path casts its scales once, at load -------------------------------------------------------


def _scale_ops(layer, names, call):
    """The ops ``call`` dispatches that make a new tensor from one of the layer's scale tensors ``names``
    (a cast, a reciprocal; not a view, nor a ``to`` that returns the tensor itself), outside the torch_npu
    operators (which read them as they are)."""
    from ascend_adapters.testing.capture import HostReads

    def storages(tree):
        leaves = torch.utils._pytree.tree_leaves(tree)
        return {a.untyped_storage().data_ptr() for a in leaves if isinstance(a, torch.Tensor)}

    scales = storages([getattr(layer, n) for n in names])

    class ScaleOps(HostReads):
        def __init__(self):
            super().__init__()
            self.on_scales: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            in_kernel = self._in_kernel
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if not in_kernel and func.namespace == "aten" and storages((args, kwargs)) & scales:
                if not storages(out) & scales:
                    self.on_scales.append(str(func))
            return out

    with ScaleOps() as ops:
        out = call()
    assert ops.kernels, "the call did not take the emulated NPU operators"
    return out, ops.on_scales


@pytest.mark.parametrize("kind", ["static", "dynamic", "moe"])
def test_npu_kernels_cast_no_scale_per_call(vllm_env, kind):
    """In a bfloat16 model the NPU operators take the activation scale and offset of a static linear
    (npu_quantize: 1 / scale and the offset in the input's dtype) and the experts' weight scales
    (npu_grouped_matmul: bfloat16) in another form than the checkpoint's float32: process_weights_after_loading
    makes that form once (``modelslim.pack_input_quant``, ``modelslim.pack_moe_scale``), so a call
    dispatches no op on a scale besides views (the old NPU twins cast, and took the reciprocal, on every
    call). Through the torch_npu contract emulator: CPU tensors take the NPU implementations."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    from ascend_adapters.common.quant.linear import encode_deq_scale
    from ascend_adapters.testing.capture import emulated_npu_kernels
    from ascend_adapters.testing.modelslim import quantize_weight_per_channel

    g = torch.Generator().manual_seed(5)
    k, n = 48, 40
    with emulated_npu_kernels():
        if kind == "moe":
            e, h, i = 4, 64, 32
            types = {f"m.mlp.experts.{x}.{p}.weight": "W8A8_DYNAMIC" for x in range(e) for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
            experts = _moe_layer(_config(types), e, h, i, params_dtype=torch.bfloat16).routed_experts
            ckpt = []
            for x in range(e):
                for p, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                    q, s = quantize_weight_per_channel(torch.randn(*shape, generator=g) * 0.05)
                    ckpt += [(f"{x}.{p}.weight", q), (f"{x}.{p}.weight_scale", s)]
                    ckpt.append((f"{x}.{p}.weight_offset", torch.zeros_like(s)))
            assert "w13_weight_scale" in set(experts.load_weights(ckpt))
            _finish(experts)
            xs = torch.randn(7, h, generator=g).to(torch.bfloat16)
            ids = torch.randint(0, e, (7, 2), generator=g).to(torch.int32)
            topk_w = torch.rand(7, 2, generator=g)

            def call():
                return experts.quant_method.apply(experts, xs, topk_w, ids, None, None)

            layer, names = experts, ("w13_weight_scale", "w2_weight_scale")
        else:
            qtype = "W8A8" if kind == "static" else "W8A8_DYNAMIC"
            layer = ReplicatedLinear(
                k,
                n,
                bias=False,
                quant_config=_config({"m.proj.weight": qtype}),
                prefix="m.proj",
                params_dtype=torch.bfloat16,
            )
            _load(layer, "weight", torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8))
            if kind == "static":
                _load(layer, "deq_scale", encode_deq_scale(torch.rand(n, generator=g) * 1e-4))
                _load(layer, "quant_bias", torch.randint(-900, 900, (n,), generator=g, dtype=torch.int32))
                _load(layer, "input_scale", torch.tensor([0.03]))
                _load(layer, "input_offset", torch.tensor([4.0]))
                names = ("input_scale", "input_offset", "deq_scale", "quant_bias")
            else:
                _load(layer, "weight_scale", torch.rand(n, 1, generator=g) * 1e-2)
                _load(layer, "weight_offset", torch.zeros(n, 1))
                names = ("weight_scale",)
            _finish(layer)
            xs = torch.randn(5, k, generator=g).to(torch.bfloat16)

            def call():
                return layer(xs)[0]

        out, on_scales = _scale_ops(layer, names, call)
    assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out).all())
    assert on_scales == [], on_scales
