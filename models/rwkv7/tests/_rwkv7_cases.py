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


def step_metadata(q_cpu, num_decodes, seq_lens, rows, *, query_start_loc=None, num_tokens=None):
    """The state backend's metadata for one step, as ``Rwkv7StateMetadataBuilder`` makes it: requests whose
    query starts are ``q_cpu`` (host ints, decodes first; its host values come from the builder's
    ``host_values``), ``seq_lens`` ``[R]`` and ``rows`` (``[R, 1 + k]`` under speculation, else ``[R]``),
    and ``query_start_loc``, the device copy of ``q_cpu`` (made from it when not given). ``num_tokens``: the
    token count of a captured decode batch, which vLLM pads beyond its last request's tokens."""
    import torch

    from ascend_adapters.rwkv7.model import Rwkv7StateMetadata, Rwkv7StateMetadataBuilder

    n, nd = len(q_cpu) - 1, num_decodes
    width, bounds = Rwkv7StateMetadataBuilder.host_values(torch.tensor(q_cpu), nd, n - nd, rows.dim() == 2)
    md = Rwkv7StateMetadata(
        num_prefills=n - nd,
        num_prefill_tokens=q_cpu[-1] - q_cpu[nd],
        num_decodes=nd,
        num_decode_tokens=num_tokens if num_tokens is not None else q_cpu[nd],
        query_start_loc=None,
        seq_lens=None,
        state_indices_tensor=None,
        decode_width=width,
        prefill_bounds=bounds,
    )
    qsl = torch.tensor(q_cpu, dtype=torch.int32) if query_start_loc is None else query_start_loc
    return with_tensors(md, qsl, seq_lens, rows)


def with_tensors(md, query_start_loc, seq_lens, rows):
    """``md`` (host values of a step) with these device tensors; a fresh object (no split made yet)."""
    import dataclasses

    speculative = rows.dim() == 2
    return dataclasses.replace(
        md,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        state_indices_tensor=rows[:, 0] if speculative else rows,
        state_rows=rows if speculative else None,
    )
