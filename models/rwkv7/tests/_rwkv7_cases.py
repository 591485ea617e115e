"""Shared tiny checkpoints for the rwkv7 tests (BlinkDL .pth -> converter -> HF dir)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from ascend_adapters.rwkv7.convert import convert
from ascend_adapters.rwkv7.tiny import blinkdl_state_dict, self_repeating, write_pth

# name -> shape; head size 64 as released models, and a smaller one with another head count
CASES = {
    "h64x2_l3": {"n_layer": 3, "n_embd": 128, "head_size": 64, "vocab": 1024, "seed": 1},
    "h32x3_l2": {"n_layer": 2, "n_embd": 96, "head_size": 32, "vocab": 1024, "seed": 2},
}

# tensor parallelism: 4 heads give 2 per rank at TP=2 (a group norm of two groups per rank)
TP_CASES = {"h32x4_l2": {"n_layer": 2, "n_embd": 128, "head_size": 32, "vocab": 1024, "seed": 3}}


def build_case(root: Path, name: str, *, repeating: bool = False) -> tuple[Path, Path]:
    """(source .pth, converted HF dir). ``repeating``: the checkpoint made to repeat itself
    (``tiny.self_repeating``: text n-gram speculation can draft)."""
    spec = {**CASES, **TP_CASES}[name]
    sd = blinkdl_state_dict(**spec)
    if repeating:
        sd, name = self_repeating(sd), f"{name}_repeating"
    pth = write_pth(root / f"{name}.pth", sd)
    out = convert(pth, root / name, log=lambda *_: None)
    return pth, out


def prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def engine_configs(cases, tmp_path) -> dict:
    """Build vLLM's engine config for each ``[name, model_dir, engine_kwargs]`` in a subprocess;
    returns ``{name: "OK" or the error message}``."""
    spec, out = tmp_path / "cases.json", tmp_path / "out.json"
    spec.write_text(json.dumps(cases))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "_rwkv7_engine_config.py"), str(spec), str(out)],
        env={**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def build_inprocess_model(ckpt: Path, state_rows: int):
    """``(vllm_config, model)``: the checkpoint's vLLM model built in this process, weights loaded and
    prepacked as the engine does, each layer with a random state cache of ``state_rows`` rows."""
    import torch
    from safetensors.torch import load_file
    from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    from ascend_adapters.rwkv7 import register
    from ascend_adapters.testing.inprocess import ensure_single_rank_parallel_state

    register()
    mc = ModelConfig(model=str(ckpt), dtype="float32", max_model_len=256, skip_tokenizer_init=True)
    cfg = VllmConfig(model_config=mc, cache_config=CacheConfig(enable_prefix_caching=False))
    with set_current_vllm_config(cfg):
        ensure_single_rank_parallel_state()
        model = initialize_model(cfg)
    model.load_weights(iter(load_file(str(ckpt / "model.safetensors")).items()))
    with set_current_vllm_config(cfg):
        process_weights_after_loading(model, mc, torch.device("cpu"))  # vLLM's CPU linears prepack here
    for layer in model.model.layers:
        shapes, dtypes = layer.get_state_shape(), layer.get_state_dtype()
        layer.kv_cache = tuple(torch.randn(state_rows, *s).to(d) for s, d in zip(shapes, dtypes))
    return cfg, model
