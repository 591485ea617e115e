"""Bad inputs fail closed with a clear reason: unit level (policy, name rules) and through real vLLM start-up."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from _glm_dsa_ref import add_tensor, build, random_prompts
from _glm_dsa_w8a8 import ATTN_LINEARS, make_export

from ascend_adapters.common import remap
from ascend_adapters.common.testing.evidence import EvidenceRecord
from ascend_adapters.common.testing.parity import DEFAULT_LLM_KWARGS
from ascend_adapters.glm_dsa.config import (
    SPARSE_ENV,
    AttentionMode,
    GlmDsaConfigError,
    check_raw_config,
    choose_attention_mode,
)
from ascend_adapters.glm_dsa.remap import glm_dsa_rules


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


def _remapper(dense, targets):
    return remap.Remapper(glm_dsa_rules(3, 1, [2], dense), targets=targets)


def test_name_rules():
    owned = {"model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.indexer.wk.weight"}
    r = _remapper(False, owned)
    names = [
        "rot.weight",
        "model.layers.3.eh_proj.weight",
        "model.layers.3.self_attn.q_a_proj.weight",
        "model.layers.2.self_attn.indexer.wk.weight",
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.self_attn.indexer.wk.weight",
    ]
    got = [n for n, _ in r.apply((n, None) for n in names)]
    rep = r.finish()
    assert got == names[4:]
    assert set(rep.skipped) == set(names[:4])
    # dense: every indexer tensor is reported unused, by name
    r = _remapper(True, owned)
    list(r.apply([("model.layers.0.self_attn.indexer.wk.weight", None)]))
    assert "indexer unused" in r.finish().skipped["model.layers.0.self_attn.indexer.wk.weight"]
    # nothing broader than rot.weight at top level, and unknown names are errors naming the tensor
    r = _remapper(False, owned)
    list(r.apply([("rot.bias", None), ("model.layers.0.self_attn.bogus.weight", None)]))
    with pytest.raises(remap.RemapError) as err:
        r.finish()
    assert "UNMAPPED rot.bias" in str(err.value) and "UNMAPPED model.layers.0.self_attn.bogus.weight" in str(err.value)


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
            "ascend_adapters.common.testing.parity_worker",
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
        if any(s in ln for s in ("GlmDsaConfigError", "Value error", "RemapError", "UNMAPPED"))
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
    ok = "model.layers.1.self_attn.bogus_proj.weight" in log and "match no rule" in log
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
