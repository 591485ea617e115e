"""Weight loading on the vLLM model built in this process (common's loader around vLLM's
``AutoWeightsLoader``; no engine start): every tensor lands, a missing or unknown one is refused by name.
Building the model changes nothing in vLLM: the CPU-platform patches it needs are applied by the plugin's
``register()``."""

from __future__ import annotations

import re

import pytest
import torch

from ascend_adapters.common.loading import CheckpointError
from ascend_adapters.rwkv7.tiny import make_tiny


@pytest.fixture(scope="module")
def loader_case(tmp_path_factory):
    from safetensors.torch import load_file
    from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    from ascend_adapters.rwkv7 import register
    from ascend_adapters.testing.inprocess import ensure_single_rank_parallel_state

    register()
    ckpt = make_tiny(tmp_path_factory.mktemp("rwkv7_loader") / "tiny")
    tensors = load_file(str(ckpt / "model.safetensors"))

    def build(mamba_cache_mode=None):
        mc = ModelConfig(model=str(ckpt), dtype="float32", max_model_len=256, skip_tokenizer_init=True)
        cfg = VllmConfig(model_config=mc, cache_config=CacheConfig(enable_prefix_caching=False))
        if mamba_cache_mode is not None:
            cfg.cache_config.mamba_cache_mode = mamba_cache_mode
        with set_current_vllm_config(cfg):
            ensure_single_rank_parallel_state()
            return initialize_model(cfg)

    return build, tensors


def test_every_tensor_lands(loader_case):
    build, tensors = loader_case
    model = build()
    loaded = model.load_weights(iter(tensors.items()))
    assert loaded == {n for n, _ in model.named_parameters()}
    name = next(n for n in tensors if n.endswith("attn.k_proj.weight"))
    assert torch.equal(dict(model.named_parameters())[name], tensors[name])


def test_missing_tensor_is_refused_naming_it(loader_case):
    build, tensors = loader_case
    drop = next(n for n in tensors if n.endswith("ffn.value.weight"))
    with pytest.raises(CheckpointError, match=rf"^RWKV-7 checkpoint lacks 1 tensor\(s\) .*\['{re.escape(drop)}'\]"):
        build().load_weights((n, t) for n, t in tensors.items() if n != drop)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.attn.bogus.weight",
        "mystery.weight",
        "model.layers.0.attn.k_proj.bias",  # vLLM's loader drops unexpected '.bias' silently (its GPTQ rule)
        "lm_head.bias",
    ],
)
def test_unknown_tensor_is_refused_naming_it(loader_case, name):
    build, tensors = loader_case
    with pytest.raises(CheckpointError, match=rf"^RWKV-7 checkpoint tensor {re.escape(name)}\b"):
        build().load_weights([*tensors.items(), (name, torch.zeros(4, 4))])


def test_register_applies_the_cpu_patches_and_building_the_model_none(loader_case, monkeypatch):
    """``register()`` (the fixture ran it) installs the CPU-platform patches this model needs (the state-block
    copy of prefix caching, the receive buffers of a later pipeline stage); building a model in prefix
    caching's "align" mode leaves vLLM as it found it."""
    from vllm.v1.worker import mamba_utils
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    build, _ = loader_case
    assert getattr(mamba_utils.batch_memcpy, "_ascend_adapters_cpu", False)
    assert getattr(CPUModelRunner.sync_and_gather_intermediate_tensors, "_ascend_adapters_cpu", False)

    def unpatched(*args):  # stands for vLLM's own function: a patch applied now would replace it
        raise AssertionError("not called")

    monkeypatch.setattr(mamba_utils, "batch_memcpy", unpatched)
    monkeypatch.setattr(CPUModelRunner, "sync_and_gather_intermediate_tensors", unpatched)
    build(mamba_cache_mode="align")
    assert mamba_utils.batch_memcpy is unpatched
    assert CPUModelRunner.sync_and_gather_intermediate_tensors is unpatched
