"""Admission on real msmodelslim exports (dynamic and static W8A8 of the tiny Llama) and on the
project's documented-math exporter (testing.modelslim.export_w8a8), including MoE-style and old-style
layouts. Skips, with the reason printed, when msmodelslim is not installed."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_admission_fuzz import KINDS, STRUCTURAL, mutate, named
from test_admission_support import copy_artifact, rewrite_without, shards_of

from ascend_adapters.common.admission import build_manifest, check_dir, inspect_dir
from ascend_adapters.common.admission.report import Report
from ascend_adapters.testing import modelslim


@pytest.fixture(scope="module")
def real_exports(tiny_llama_modelslim_exports):
    dirs = tiny_llama_modelslim_exports
    out = {}
    for mode in ("dynamic", "static"):
        manifest, report = build_manifest(dirs[mode], progress=False)
        assert manifest is not None, report.format()
        out[mode] = (dirs[mode], manifest)
    return out


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_real_msmodelslim_export_admitted(real_exports, mode):
    d, manifest = real_exports[mode]
    report = check_dir(d, manifest, progress=False)
    assert report.ok, report.format()
    desc = json.loads((d / "quant_model_description.json").read_text())
    ms = manifest["modelslim"]
    assert ms["model_quant_type"] == desc["model_quant_type"] == ("W8A8_DYNAMIC" if mode == "dynamic" else "W8A8")
    assert ms["version"] == desc["version"]
    names = {t["name"] for t in manifest["tensors"]}
    assert sum(ms["type_counts"].values()) == len(names)  # every tensor described, companions included
    quant = "weight_scale" if mode == "dynamic" else "deq_scale"
    assert any(n.endswith(quant) for n in names)
    from safetensors import safe_open

    for rel in shards_of(d):  # the torch-free header reader agrees with the safetensors library
        with safe_open(str(d / rel), "pt") as f:
            for k in f.keys():
                t = next(t for t in manifest["tensors"] if t["name"] == k)
                assert (t["file"], t["shape"]) == (rel, list(f.get_slice(k).get_shape()))


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_real_export_companion_removed(real_exports, mode, tmp_path):
    src, manifest = real_exports[mode]
    d = copy_artifact(src, tmp_path / mode)
    victim = "model.layers.1.mlp.down_proj." + ("weight_offset" if mode == "dynamic" else "quant_bias")
    rewrite_without(d, victim)
    r = Report()
    inspect_dir(d, r)
    assert {p.code for p in r.errors} == {"ms-companion-missing", "ms-missing-tensor"}, r.format()
    assert any(p.where == victim for p in r.errors)
    assert not check_dir(d, manifest, progress=False).ok


@settings(
    max_examples=int(os.environ.get("ADMISSION_FUZZ_EXAMPLES_REAL", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_real_export_mutations_refused(real_exports, data):
    mode = data.draw(st.sampled_from(["dynamic", "static"]), label="mode")
    kind = data.draw(st.sampled_from(KINDS), label="kind")
    src, manifest = real_exports[mode]
    with tempfile.TemporaryDirectory() as tmp:
        d = copy_artifact(src, Path(tmp) / "model")
        (Path(tmp) / "outside").mkdir()
        culprits = mutate(data, kind, d, Path(tmp) / "outside")
        if culprits is None:
            return
        report = check_dir(d, manifest, progress=False)
        assert not report.ok and not [p for p in report.errors if p.code == "internal"], report.format()
        assert all(named(report, c) for c in culprits), report.format()
        if kind in STRUCTURAL:
            assert not check_dir(d, manifest, verify_hashes=False, progress=False).ok


def _ranges(src: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), "pt") as f:
        prefixes = [k[: -len(".weight")] for k in f.keys() if k.endswith("_proj.weight")]
    return {p: (-4.0, 4.0) for p in prefixes}


@pytest.mark.parametrize("style", ["new", "old"])
def test_documented_exporter_admitted(tmp_path, style):
    from ascend_adapters.testing.factory import make_tiny_llama

    src = make_tiny_llama(tmp_path / "float", seed=3)
    plan = {"*.self_attn.*": "W8A8", "*.mlp.*": "W8A8_DYNAMIC"}
    out = modelslim.export_w8a8(src, tmp_path / "export", plan, input_ranges=_ranges(src), style=style)
    manifest, report = build_manifest(out, progress=False)
    assert manifest is not None, report.format()
    assert manifest["modelslim"]["model_quant_type"] == "W8A8_MIX"
    assert set(manifest["modelslim"]["type_counts"]) == {"FLOAT", "W8A8", "W8A8_DYNAMIC"}
    assert check_dir(out, manifest, progress=False).ok
    if style == "old":
        assert any(f["path"].startswith("quant_model_weight_w8a8") for f in manifest["files"])


def test_documented_exporter_per_expert_layout(tmp_path):
    """Per-expert MoE names (experts.{e}.gate_proj/up_proj/down_proj) with W8A8_DYNAMIC companions."""
    import torch

    from ascend_adapters.testing.factory import make_checkpoint, tiny_llama_config

    cfg = tiny_llama_config(num_hidden_layers=1)
    g = torch.Generator().manual_seed(0)
    h, i, e = cfg["hidden_size"], 64, 4
    w = {
        "model.embed_tokens.weight": torch.randn(cfg["vocab_size"], h, generator=g),
        "model.norm.weight": torch.ones(h),
    }
    for x in range(e):
        p = f"model.layers.0.mlp.experts.{x}."
        w |= {p + "gate_proj.weight": torch.randn(i, h, generator=g), p + "up_proj.weight": torch.randn(i, h, generator=g),
              p + "down_proj.weight": torch.randn(h, i, generator=g)}  # fmt: skip
    src = make_checkpoint(tmp_path / "moe", cfg, w, tokenizer=False)
    out = modelslim.export_w8a8(src, tmp_path / "export", {"*.experts.*": "W8A8_DYNAMIC"}, max_shard_bytes=60_000)
    manifest, report = build_manifest(out, progress=False)
    assert manifest is not None, report.format()
    desc = json.loads((out / "quant_model_description.json").read_text())
    desc["model.layers.0.mlp.experts.2.up_proj.weight"] = "FLOAT"  # fused gate/up of one expert now differ
    (out / "quant_model_description.json").write_text(json.dumps(desc))
    r = Report()
    inspect_dir(out, r)
    assert any(p.code == "ms-fused-type" and "experts.2" in p.where for p in r.errors), r.format()
