"""Bad inputs fail closed with a clear reason: unit level (policy, name rules), the weight loader on a model
built in-process (no engine), and through real vLLM start-up."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from _glm_dsa_ref import add_tensor, build, random_prompts
from _glm_dsa_w8a8 import ATTN_LINEARS, make_export

from ascend_adapters.common import compat
from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.glm_dsa import remap
from ascend_adapters.glm_dsa.config import (
    SPARSE_ENV,
    AttentionMode,
    GlmDsaConfigError,
    check_raw_config,
    choose_attention_mode,
)
from ascend_adapters.testing.parity import DEFAULT_LLM_KWARGS


class _Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


# -- policy (no engine) ------------------------------------------------------------------------------------


def test_mode_choice(monkeypatch):
    monkeypatch.delenv(SPARSE_ENV, raising=False)
    cfg = _Cfg(index_topk=8)
    assert choose_attention_mode(cfg, 8) is AttentionMode.DENSE
    assert choose_attention_mode(cfg, 9) is AttentionMode.SPARSE
    monkeypatch.setenv(SPARSE_ENV, "force")
    assert choose_attention_mode(cfg, 8) is AttentionMode.SPARSE
    monkeypatch.setenv(SPARSE_ENV, "0")
    assert choose_attention_mode(cfg, 8) is AttentionMode.DENSE
    with pytest.raises(GlmDsaConfigError, match=r"max_model_len=9 exceeds index_topk=8.*--max-model-len 8"):
        choose_attention_mode(cfg, 9)
    monkeypatch.setenv(SPARSE_ENV, "maybe")
    with pytest.raises(GlmDsaConfigError, match=SPARSE_ENV):
        choose_attention_mode(cfg, 9)


def test_missing_index_topk_unit():
    with pytest.raises(GlmDsaConfigError, match="no 'index_topk'"):
        check_raw_config({"model_type": "glm_moe_dsa"})
    check_raw_config({"index_topk": 2048})
    with pytest.raises(GlmDsaConfigError, match="index_topk"):
        choose_attention_mode(_Cfg(index_topk=None), 8)


MTP_NAMES = ["model.layers.3.eh_proj.weight", "model.layers.3.self_attn.q_a_proj.weight"]


def _drops(dense: bool) -> tuple[dict, object]:
    """The tiny layout (3 layers, 1 MTP layer, layer 2 'shared'): its skip rules and the mapper built from them."""
    rules = remap.skip_rules(3, 1, [2], dense)
    return rules, compat.weights_mapper_fn(remap.hf_to_vllm_mapper | remap.skip_mapper(rules))


def _reason(rules: dict[str, str], name: str) -> str:
    return next(reason for pattern, reason in rules.items() if re.search(pattern, name))


def test_name_rules():
    kept = [
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.self_attn.indexer.wk.weight",
        "model.layers.30.self_attn.q_a_proj.weight",  # a main layer of a deeper model, not MTP layer 3
        "rot.bias",  # nothing broader than rot.weight at top level: the loader refuses it (test below)
    ]
    skipped = ["rot.weight", *MTP_NAMES, "model.layers.2.self_attn.indexer.wk.weight"]
    rules, map_name = _drops(dense=False)
    assert [map_name(n) for n in kept] == kept  # the released names are the model's: nothing renamed
    assert [map_name(n) for n in skipped] == [None] * len(skipped)
    assert "MTP layer" in _reason(rules, MTP_NAMES[0]) and "'shared' layer" in _reason(rules, skipped[-1])
    # dense: every indexer tensor is dropped, with the reason
    rules, map_name = _drops(dense=True)
    assert map_name("model.layers.0.self_attn.indexer.wk.weight") is None
    assert "indexer unused" in _reason(rules, "model.layers.0.self_attn.indexer.wk.weight")
    # the class mapper (also given to the quantization config) drops only what every export carries
    fixed = compat.weights_mapper_fn(remap.hf_to_vllm_mapper)
    assert fixed("rot.weight") is None and fixed(MTP_NAMES[0]) == MTP_NAMES[0]


# -- the weight loader on a model built in-process (vLLM's own layers and loader, no engine) ----------------


def _built(ckpt):
    """The GlmMoeDsaForCausalLM vLLM builds for ``ckpt`` (sparse path, max_model_len 64; quantization
    detected as at serve time), nothing loaded."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from ascend_adapters.testing.inprocess import ensure_single_rank_parallel_state

    vllm_config = EngineArgs(model=str(ckpt), **{**DEFAULT_LLM_KWARGS, "max_model_len": 64}).create_engine_config()
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.float32):
        ensure_single_rank_parallel_state()
        return initialize_model(vllm_config=vllm_config, model_config=vllm_config.model_config)


@pytest.fixture(scope="module")
def loader_case(tmp_path_factory):
    """The tiny checkpoint's tensors and a GlmMoeDsaForCausalLM built for it."""
    from safetensors.torch import load_file

    ckpt = build(tmp_path_factory.mktemp("glm_dsa_loader"), "tiny", index_topk=8)
    # in name order, as vLLM reads a safetensors file ('rot.weight' after every 'model.' tensor)
    return _built(ckpt), dict(sorted(load_file(str(ckpt / "model.safetensors")).items()))


def test_loader_skips_and_loads(loader_case):
    model, tensors = loader_case
    assert model.model.mode is AttentionMode.SPARSE
    shared_indexer = "model.layers.2.self_attn.indexer.wk.weight"  # exports may carry one; layer 2 is 'shared'
    loaded = model.load_weights([*tensors.items(), (shared_indexer, torch.zeros(32, 128))])
    assert loaded == set(dict(model.named_parameters()))
    extras = {"rot.weight", shared_indexer} | {n for n in tensors if n.startswith("model.layers.3.")}
    assert set(model.skipped_weights) == extras
    assert "'shared' layer" in model.skipped_weights[shared_indexer]
    # a shard order that splits the 'model.' tensors (and one expert's tensors) into two groups
    names = list(tensors)
    half = names.index("model.layers.1.mlp.experts.3.down_proj.weight")
    split = [*names[1:half], names[0], *names[half:]]
    assert names[0] == "lm_head.weight"
    assert model.load_weights((n, tensors[n]) for n in split) == loaded
    # stacked and per-expert tensors landed in their slices
    params = dict(model.named_parameters())
    mlp = "model.layers.0.mlp."
    want = torch.cat([tensors[mlp + "gate_proj.weight"], tensors[mlp + "up_proj.weight"]])
    assert torch.equal(params[mlp + "gate_up_proj.weight"], want)
    (w2,) = [p for n, p in params.items() if n.startswith("model.layers.1.mlp.experts.") and n.endswith("w2_weight")]
    assert torch.equal(w2[3], tensors["model.layers.1.mlp.experts.3.down_proj.weight"])


@pytest.mark.parametrize(
    "name",
    [
        "rot.bias",  # unknown top-level module: vLLM's loader names 'rot', the adapter the tensor
        "model.layers.1.self_attn.bogus_proj.weight",
        "model.layers.1.mlp.experts.0.bogus_proj.weight",
        "model.layers.0.mlp.gate_proj.bias",
    ],
)
def test_loader_unknown_tensor_is_an_error_naming_it(loader_case, name):
    model, tensors = loader_case
    with pytest.raises(remap.GlmDsaWeightsError, match=rf"^GLM-DSA checkpoint tensor {re.escape(name)}\b"):
        model.load_weights([*tensors.items(), (name, torch.zeros(4, 4))])


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.1.mlp.experts.3.down_proj.weight",  # one expert's down projection
        "model.layers.0.mlp.up_proj.weight",  # one shard of the fused gate_up_proj
        "model.layers.1.mlp.shared_experts.gate_proj.weight",
    ],
)
def test_loader_missing_tensor_is_an_error_naming_it(loader_case, name):
    """vLLM's own check after loading runs only for unquantized models and exempts every layer it
    post-processes (all linears), and a fused parameter (one FusedMoE parameter holds every expert,
    gate_up_proj both shards) counts as loaded once any piece of it is: common's loader checks."""
    model, tensors = loader_case
    with pytest.raises(remap.GlmDsaWeightsError, match=rf"^GLM-DSA checkpoint lacks 1 .*\['{re.escape(name)}'\]"):
        model.load_weights([(n, t) for n, t in tensors.items() if n != name])


@pytest.fixture(scope="module")
def drafter_case(tmp_path_factory):
    """The MTP drafter (``mtp.GlmMoeDsaMTP``) built for the tiny checkpoint with GLM-5.1's copies of the
    embedding and head in its MTP layer, and the checkpoint's tensors."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.torch_utils import set_default_torch_dtype

    from ascend_adapters.glm_dsa.mtp import GlmMoeDsaMTP
    from ascend_adapters.testing.inprocess import ensure_single_rank_parallel_state

    ckpt = build(tmp_path_factory.mktemp("glm_dsa_drafter"), "tiny", index_topk=8)
    vllm_config = EngineArgs(model=str(ckpt), **{**DEFAULT_LLM_KWARGS, "max_model_len": 64}).create_engine_config()
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.float32):
        ensure_single_rank_parallel_state()
        drafter = GlmMoeDsaMTP(vllm_config=vllm_config)
    return drafter, dict(sorted(load_file(str(ckpt / "model.safetensors")).items()))


def test_drafter_loads_its_layer_and_skips_the_rest(drafter_case):
    drafter, tensors = drafter_case
    loaded = drafter.load_weights(tensors.items())
    assert loaded == set(dict(drafter.named_parameters()))
    assert all(n.startswith("model.layers.3.") for n in loaded)
    copies = {"model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"}
    mtp = {n for n in tensors if n.startswith("model.layers.3.")} - copies
    assert mtp and not mtp & set(drafter.skipped_weights) and copies <= set(drafter.skipped_weights)
    assert "shares the target's" in drafter.skipped_weights["model.layers.3.shared_head.head.weight"]
    assert "owns only its MTP layers" in drafter.skipped_weights["model.layers.0.self_attn.q_a_proj.weight"]


@pytest.mark.parametrize(
    "name",
    ["model.layers.3.eh_proj.weight", "model.layers.3.hnorm.weight", "model.layers.3.self_attn.kv_b_proj.weight"],
)
def test_drafter_missing_mtp_tensor_is_an_error_naming_it(drafter_case, name):
    """An export whose MTP layer lost a tensor (the most reported MTP failure) does not serve a half-loaded drafter."""
    drafter, tensors = drafter_case
    with pytest.raises(remap.GlmDsaWeightsError, match=rf"^GLM-DSA MTP checkpoint lacks 1 .*\['{re.escape(name)}'\]"):
        drafter.load_weights([(n, t) for n, t in tensors.items() if n != name])


def test_drafter_loads_from_a_w8a8_export_whose_description_omits_the_mtp_layer(tmp_path):
    """Released W8A8 exports mark the MTP layer FLOAT or leave it out of the description: both load float."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.torch_utils import set_default_torch_dtype

    from ascend_adapters.glm_dsa.mtp import GlmMoeDsaMTP
    from ascend_adapters.testing.inprocess import ensure_single_rank_parallel_state

    src = build(tmp_path, "src", index_topk=8)
    export = make_export(src, tmp_path / "w8a8", n_layers=3)
    path = export / "quant_model_description.json"
    desc = json.loads(path.read_text())
    assert {v for k, v in desc.items() if k.startswith("model.layers.3.")} == {"FLOAT"}
    path.write_text(json.dumps({k: v for k, v in desc.items() if not k.startswith("model.layers.3.")}))
    kwargs = {**DEFAULT_LLM_KWARGS, "max_model_len": 64, "quantization": "modelslim"}
    vllm_config = EngineArgs(model=str(export), **kwargs).create_engine_config()
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.float32):
        ensure_single_rank_parallel_state()
        drafter = GlmMoeDsaMTP(vllm_config=vllm_config)
    tensors = {}
    for f in sorted(export.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    assert drafter.load_weights(tensors.items()) == set(dict(drafter.named_parameters()))
    eh_proj = drafter.model.layers["3"].eh_proj
    assert type(eh_proj.quant_method).__name__ == "ModelSlimFloatLinearMethod"


def test_drafter_unknown_mtp_tensor_is_an_error_naming_it(drafter_case):
    drafter, tensors = drafter_case
    name = "model.layers.3.bogus_proj.weight"
    with pytest.raises(remap.GlmDsaWeightsError, match=rf"^GLM-DSA MTP checkpoint tensor {re.escape(name)}\b"):
        drafter.load_weights([*tensors.items(), (name, torch.zeros(4, 4))])


# -- real vLLM start-up --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    return build(tmp_path_factory.mktemp("glm_dsa_bad"), "tiny", index_topk=8)


def _variant(base, tmp_path, name):
    out = tmp_path / name
    shutil.copytree(base, out)
    return out


def _start_fails(ckpt, tmp_path, env=None, max_model_len=64, **llm_kwargs) -> str:
    """Start vLLM through the parity worker and return its whole log (the helper keeps only a short tail,
    in which the engine's own traceback hides the root cause)."""
    spec = {
        "model": str(ckpt),
        "runs": [random_prompts([4])],
        "max_tokens": 1,
        "llm_kwargs": {**DEFAULT_LLM_KWARGS, "max_model_len": max_model_len, **llm_kwargs},
    }
    spec_path = tmp_path / f"spec-{ckpt.name}.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ascend_adapters.testing.parity_worker",
            str(spec_path),
            str(tmp_path / "out.pt"),
        ],
        env={**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode != 0, "vLLM started although it should have refused"
    return proc.stdout + proc.stderr


def _excerpt(log: str) -> str:
    lines = [
        ln
        for ln in log.splitlines()
        if any(s in ln for s in ("GlmDsaConfigError", "Value error", "GLM-DSA checkpoint"))
    ]
    return "\n".join(lines[:6])


@pytest.mark.vllm
@pytest.mark.gate
def test_bad_inputs_refused_by_vllm(base_ckpt, tmp_path, evidence_root):
    rec = EvidenceRecord(model="glm_dsa", gate="bad_inputs")

    log = _start_fails(base_ckpt, tmp_path, env={SPARSE_ENV: "0"}, max_model_len=128)
    ok = "max_model_len=128 exceeds index_topk=8" in log and "--max-model-len 8" in log
    rec.check(
        f"{SPARSE_ENV}=0 with max_model_len 128 > index_topk 8: start-up refused with the largest allowed value",
        ok,
        _excerpt(log),
    )
    assert ok, log

    bogus = _variant(base_ckpt, tmp_path, "bogus")
    add_tensor(bogus, "model.layers.1.self_attn.bogus_proj.weight")
    log = _start_fails(bogus, tmp_path)
    ok = "GLM-DSA checkpoint tensor model.layers.1.self_attn.bogus_proj.weight" in log and "no skip rule" in log
    rec.check("unknown tensor name: start-up refused naming the tensor", ok, _excerpt(log))
    assert ok, log

    no_topk = _variant(base_ckpt, tmp_path, "no_topk")
    cfg = json.loads((no_topk / "config.json").read_text())
    del cfg["index_topk"]
    (no_topk / "config.json").write_text(json.dumps(cfg))
    log = _start_fails(no_topk, tmp_path)
    ok = "no 'index_topk'" in log
    rec.check("index_topk missing from config.json: start-up refused", ok, _excerpt(log))
    assert ok, log

    # attention runs in the latent space with kv_b_proj folded in: a W8A8 kv_b_proj cannot be absorbed
    quant_kv_b = make_export(base_ckpt, tmp_path / "w8a8_kv_b", n_layers=3, attn_linears=(*ATTN_LINEARS, "kv_b_proj"))
    log = _start_fails(quant_kv_b, tmp_path, quantization="modelslim")
    ok = "model.layers.0.self_attn.kv_b_proj: quantized" in log and "must be a float tensor" in log
    rec.check("W8A8 kv_b_proj: start-up refused naming the tensor", ok, _excerpt(log))
    assert ok, log
    rec.command("vllm.LLM(...) start-up on four broken variants of the tiny checkpoint")
    rec.write(evidence_root)


def test_registration_switch(monkeypatch):
    from ascend_adapters import glm_dsa
    from ascend_adapters.common.flags import FlagError
    from ascend_adapters.common.registry import decide

    def serves():
        return decide("GlmMoeDsaForCausalLM", glm_dsa.ARCHITECTURES["GlmMoeDsaForCausalLM"], glm_dsa.ENABLE_ENV).serves

    monkeypatch.setenv(glm_dsa.ENABLE_ENV, "off")
    assert serves() == "native"
    monkeypatch.setenv(glm_dsa.ENABLE_ENV, "on")
    assert serves() == "adapter"
    monkeypatch.setenv(glm_dsa.ENABLE_ENV, "auto")
    assert serves() == "adapter"  # CPU has no native sparse-MLA path
    monkeypatch.setenv(glm_dsa.ENABLE_ENV, "sometimes")
    with pytest.raises(FlagError, match=glm_dsa.ENABLE_ENV):
        serves()


def test_speculative_methods_other_than_mtp_are_refused_in_one_line():
    from types import SimpleNamespace

    from ascend_adapters.glm_dsa.policy import check_startup

    spec = SimpleNamespace(method="ngram", num_speculative_tokens=3)
    with pytest.raises(
        GlmDsaConfigError,
        match=r"speculative decoding method 'ngram' is not served .*served: mtp.*--speculative-config",
    ):
        check_startup(
            SimpleNamespace(
                speculative_config=spec,
                model_config=SimpleNamespace(dtype=torch.float32),
                cache_config=SimpleNamespace(),
            )
        )


def _mtp_config(architectures, num_nextn_predict_layers=1, pp=1):
    from types import SimpleNamespace

    hf = SimpleNamespace(architectures=list(architectures), num_nextn_predict_layers=num_nextn_predict_layers)
    draft = SimpleNamespace(hf_config=hf, hf_text_config=hf)
    spec = SimpleNamespace(method="mtp", draft_model_config=draft, arch_updates=[])
    spec.update_arch_ = lambda: spec.arch_updates.append(list(hf.architectures))
    return SimpleNamespace(speculative_config=spec, parallel_config=SimpleNamespace(pipeline_parallel_size=pp))


@pytest.mark.parametrize("engine_name", ["DeepSeekMTPModel", "DeepseekV32MTPModel"])
def test_mtp_draft_is_routed_to_the_adapters_drafter(engine_name):
    """Each engine names the draft of a glm_moe_dsa target after its own DeepSeek MTP class (0.27.1/0.28.0:
    DeepSeekMTPModel, 0.32: DeepseekV32MTPModel); the policy points it at the adapter's, and tells vLLM."""
    from ascend_adapters.glm_dsa import DRAFT_ARCHITECTURES
    from ascend_adapters.glm_dsa.policy import route_mtp_draft

    cfg = _mtp_config([engine_name])
    route_mtp_draft(cfg)
    assert cfg.speculative_config.arch_updates == [list(DRAFT_ARCHITECTURES)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"architectures": ["SomeOtherMTPModel"]}, r"names the MTP draft \['SomeOtherMTPModel'\]"),
        ({"architectures": ["DeepseekV32MTPModel"], "num_nextn_predict_layers": 0}, "num_nextn_predict_layers is 0"),
        ({"architectures": ["DeepseekV32MTPModel"], "pp": 2}, "pipeline_parallel_size=2 is not served"),
    ],
    ids=["unknown-engine-draft", "no-mtp-layer", "pipeline-parallel"],
)
def test_mtp_refusals_name_the_reason(kwargs, message):
    from ascend_adapters.glm_dsa.policy import route_mtp_draft

    with pytest.raises(GlmDsaConfigError, match=message):
        route_mtp_draft(_mtp_config(**kwargs))


def test_startup_policy_wraps_vllms_hook(monkeypatch):
    """register() keeps vLLM's own hook for GlmMoeDsaForCausalLM (where it has one), then our checks."""
    from vllm.model_executor.models import config as vllm_models_config

    from ascend_adapters import glm_dsa
    from ascend_adapters.glm_dsa.policy import ARCH

    monkeypatch.setenv(glm_dsa.ENABLE_ENV, "on")
    glm_dsa.register()
    glm_dsa.register()
    cls = vllm_models_config.MODELS_CONFIG_MAP[ARCH]
    vllm_side = getattr(vllm_models_config, "GlmMoeDsaForCausalLM", vllm_models_config.VerifyAndUpdateConfig)
    assert cls.__mro__[1] is vllm_side  # installed once, over vLLM's class
    assert cls.__name__ == "GlmDsaStartupPolicy"


@pytest.mark.parametrize(
    "drop, named",
    [
        ("model.layers.1.mlp.experts.3.down_proj.", "model.layers.1.mlp.experts.3.down_proj.weight"),
        ("model.layers.1.mlp.shared_experts.up_proj.", "model.layers.1.mlp.shared_experts.up_proj.weight"),
    ],
)
def test_w8a8_export_missing_an_expert_or_a_shard_is_refused_naming_it(tmp_path_factory, drop, named):
    """The ModelSlim layout: the dropped int8 weight goes with its scale and offset."""
    from ascend_adapters.testing.modelslim import load_export

    root = tmp_path_factory.mktemp("glm_dsa_w8a8_loader")
    export = make_export(build(root, "tiny", index_topk=8), root / "w8a8", 3)
    tensors = load_export(export)[0]
    kept = [(n, t) for n, t in sorted(tensors.items()) if not n.startswith(drop)]
    assert len(kept) < len(tensors)
    with pytest.raises(remap.GlmDsaWeightsError, match=rf"^GLM-DSA checkpoint lacks \d+ .*\['{re.escape(named)}'"):
        _built(export).load_weights(kept)
