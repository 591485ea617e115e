"""Converter (BlinkDL .pth -> HF layout), config checks and bad inputs (no vLLM)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from ascend_adapters.rwkv7.config import Rwkv7Config, Rwkv7ConfigError, check_shapes, hf_tensor_shapes
from ascend_adapters.rwkv7.convert import ConversionError, convert, main
from ascend_adapters.rwkv7.remap import blinkdl_remapper
from ascend_adapters.rwkv7.tiny import blinkdl_state_dict, make_tiny, write_pth

SPEC = {"n_layer": 2, "n_embd": 64, "head_size": 32, "vocab": 300, "seed": 5}


@pytest.fixture
def pth(tmp_path):
    return write_pth(tmp_path / "m.pth", blinkdl_state_dict(**SPEC))


def _read(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118
    return out


@pytest.mark.parametrize("head_size,n_embd", [(64, 128), (32, 96)])
def test_convert_infers_config_and_maps_every_tensor(tmp_path, head_size, n_embd):
    sd = blinkdl_state_dict(n_layer=3, n_embd=n_embd, head_size=head_size, vocab=200, seed=1)
    src = write_pth(tmp_path / "m.pth", sd)
    logs = []
    out = convert(src, tmp_path / "hf", log=logs.append, tokenizer=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "rwkv7" and cfg["architectures"] == ["RWKV7ForCausalLM"]
    assert (cfg["hidden_size"], cfg["head_dim"], cfg["num_heads"]) == (n_embd, head_size, n_embd // head_size)
    assert cfg["num_hidden_layers"] == 3 and cfg["vocab_size"] == 200 and cfg["intermediate_size"] == 4 * n_embd
    assert cfg["decay_low_rank_dim"] == 16 and cfg["v_low_rank_dim"] == 8 and cfg["gate_low_rank_dim"] == 32
    # the rwkv package's ln_x eps (64e-5), read the fla way (head_dim * norm_eps)
    assert cfg["norm_eps"] * head_size == pytest.approx(64e-5)
    tensors = _read(out)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == hf_tensor_shapes(Rwkv7Config(**cfg))
    # values survive with the right transforms
    assert torch.equal(tensors["model.layers.1.attn.w_lora.lora.0.weight"], sd["blocks.1.att.w1"].t())
    assert torch.equal(tensors["model.layers.1.attn.w_lora.lora.2.weight"], sd["blocks.1.att.w2"].t())
    assert torch.equal(tensors["model.layers.2.attn.v_lora.lora.2.bias"], sd["blocks.2.att.v0"].flatten())
    assert torch.equal(tensors["model.layers.0.attn.k_k"], sd["blocks.0.att.k_k"].flatten())
    assert torch.equal(tensors["model.layers.0.attn.x_r"], sd["blocks.0.att.x_r"])
    assert torch.equal(tensors["model.layers.0.pre_norm.weight"], sd["blocks.0.ln0.weight"])
    assert torch.equal(tensors["lm_head.weight"], sd["head.weight"])
    assert any("mapped" in line for line in logs)


def test_layer0_value_lora_is_skipped_on_purpose():
    sd = blinkdl_state_dict(**SPEC)
    sd["blocks.0.att.v0"], sd["blocks.0.att.v1"], sd["blocks.0.att.v2"] = (
        sd["blocks.1.att.v0"],
        sd["blocks.1.att.v1"],
        sd["blocks.1.att.v2"],
    )
    cfg = Rwkv7Config(
        hidden_size=64,
        head_dim=32,
        num_hidden_layers=2,
        vocab_size=300,
        intermediate_size=256,
        decay_low_rank_dim=16,
        a_low_rank_dim=16,
        v_low_rank_dim=8,
        gate_low_rank_dim=32,
    )
    rm = blinkdl_remapper(targets=set(hf_tensor_shapes(cfg)))
    dict(rm.apply(sd.items()))
    report = rm.finish(required=hf_tensor_shapes(cfg))
    assert set(report.skipped) == {"blocks.0.att.v0", "blocks.0.att.v1", "blocks.0.att.v2"}
    assert not report.unmapped and not report.unused
    assert len(report.mapped) == len(sd) - 3


def test_serving_mapper_renames_lora_indices():
    """vLLM's WeightsMapper of the model class maps fla's LoRA ``Sequential`` indices to down/up."""
    from ascend_adapters.rwkv7.model import Rwkv7ForCausalLM

    m = Rwkv7ForCausalLM.hf_to_vllm_mapper
    assert m._map_name("model.layers.1.attn.w_lora.lora.0.weight") == "model.layers.1.attn.w_lora.down.weight"
    assert m._map_name("model.layers.1.attn.g_lora.lora.2.weight") == "model.layers.1.attn.g_lora.up.weight"
    assert m._map_name("model.layers.2.attn.v_lora.lora.2.bias") == "model.layers.2.attn.v_lora.up.bias"
    assert m._map_name("model.layers.0.attn.x_g") == "model.layers.0.attn.x_g"


def test_missing_tensor_is_named(tmp_path):
    sd = blinkdl_state_dict(**SPEC)
    del sd["blocks.1.att.a2"]
    with pytest.raises(ConversionError, match=r"missing tensor 'blocks\.1\.att\.a2'"):
        convert(write_pth(tmp_path / "m.pth", sd), tmp_path / "hf", tokenizer=False)
    assert not (tmp_path / "hf").exists()


def test_misshaped_tensor_is_named(tmp_path):
    sd = blinkdl_state_dict(**SPEC)
    sd["blocks.0.ffn.value.weight"] = sd["blocks.0.ffn.value.weight"][:, :100]
    with pytest.raises(
        ConversionError, match=r"'blocks\.0\.ffn\.value\.weight' has shape \[64, 100\], expected \[64, 256\]"
    ):
        convert(write_pth(tmp_path / "m.pth", sd), tmp_path / "hf", tokenizer=False)


def test_unknown_tensor_is_an_error(tmp_path):
    sd = blinkdl_state_dict(**SPEC)
    sd["blocks.1.att.time_faaaa"] = torch.zeros(4)
    with pytest.raises(ConversionError, match=r"unknown tensor 'blocks\.1\.att\.time_faaaa'"):
        convert(write_pth(tmp_path / "m.pth", sd), tmp_path / "hf", tokenizer=False)


@pytest.mark.parametrize("head_size", [16, 48])
def test_unsupported_head_size(tmp_path, head_size):
    sd = blinkdl_state_dict(n_layer=1, n_embd=96, head_size=head_size, vocab=100)
    with pytest.raises(
        ConversionError, match=rf"head size {head_size} .* not supported; supported head sizes: 32, 64, 128"
    ):
        convert(write_pth(tmp_path / "m.pth", sd), tmp_path / "hf", tokenizer=False)


def test_config_disagreeing_with_weights(tmp_path, pth):
    out = convert(pth, tmp_path / "hf", tokenizer=False)
    cfg = json.loads((out / "config.json").read_text())
    shapes = {k: tuple(v.shape) for k, v in _read(out).items()}
    check_shapes(Rwkv7Config(**cfg), shapes, "ok")
    bad = Rwkv7Config(**{**cfg, "intermediate_size": 512})
    with pytest.raises(
        Rwkv7ConfigError,
        match=r"'model\.layers\.0\.ffn\.key\.weight' has shape \[256, 64\], config implies \[512, 64\]",
    ):
        check_shapes(bad, shapes, str(out))
    with pytest.raises(Rwkv7ConfigError, match=r"missing tensor 'model\.layers\.2\.attn_norm\.weight'"):
        check_shapes(Rwkv7Config(**{**cfg, "num_hidden_layers": 3}), shapes, str(out))


def test_refuses_to_overwrite_and_cli_reports_errors(tmp_path, pth, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main([str(pth), str(out), "--no-tokenizer"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "x"
    assert main([str(tmp_path / "nope.pth"), str(tmp_path / "o2")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_module_command_and_console_script(tmp_path, pth):
    proc = subprocess.run(
        [sys.executable, "-m", "ascend_adapters.rwkv7.convert", str(pth), str(tmp_path / "a")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "a" / "model.safetensors").exists() and (tmp_path / "a" / "tokenizer_config.json").exists()
    exe = __import__("shutil").which("rwkv7-convert", path=str(__import__("pathlib").Path(sys.executable).parent))
    if exe is None:
        pytest.skip("rwkv7-convert console script not installed in this environment")
    proc = subprocess.run(
        [exe, str(pth), str(tmp_path / "b"), "--dtype", "bfloat16", "--no-tokenizer"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "b" / "config.json").read_text())["dtype"] == "bfloat16"


def test_make_tiny_writes_a_servable_dir(tmp_path):
    out = make_tiny(tmp_path / "tiny")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 65536 and (out / "rwkv_vocab_v20230424.txt").exists()


def test_checkpoint_headers_are_read_by_admissions_capped_reader(tmp_path, pth, monkeypatch):
    """config.py reads safetensors headers with common's one reader: its size cap and checks apply."""
    import struct

    from ascend_adapters.common.admission import safetensors_header
    from ascend_adapters.rwkv7.config import check_checkpoint_dir, checkpoint_shapes

    out = convert(pth, tmp_path / "hf", tokenizer=False)
    cfg = Rwkv7Config(**json.loads((out / "config.json").read_text()))
    assert checkpoint_shapes(out) == {k: tuple(v.shape) for k, v in _read(out).items()}
    check_checkpoint_dir(cfg, out)
    (st,) = sorted(out.glob("*.safetensors"))
    (n,) = struct.unpack("<Q", st.read_bytes()[:8])
    # the cap is a module constant read at call time; one byte below this header's length must refuse it
    monkeypatch.setattr(safetensors_header, "MAX_HEADER_BYTES", n - 1)
    with pytest.raises(Rwkv7ConfigError, match=rf"{st.name}: header length {n} exceeds the {n - 1}-byte limit"):
        check_checkpoint_dir(cfg, out)
    monkeypatch.undo()
    st.write_bytes(st.read_bytes()[:5])  # shorter than the 8-byte length field: named, not a struct.error
    with pytest.raises(Rwkv7ConfigError, match=rf"{st.name}: file is 5 bytes"):
        checkpoint_shapes(out)
