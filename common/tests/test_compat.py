"""compat's engine-version shims, against the installed vLLM (no engine started)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ascend_adapters.common import compat


def test_mla_attention_spec_builds_on_this_engine():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = compat.mla_attention_spec(block_size=16, num_kv_heads=1, max_tp_shards=1, head_size=96, dtype=torch.float32)
    assert isinstance(spec, MLAAttentionSpec)
    # one float32 row of 96 per token, 16 tokens per block, one KV head
    assert spec.page_size_bytes == 16 * 96 * 4
    fields = {f.name for f in dataclasses.fields(MLAAttentionSpec)}
    if "max_tp_shards" in fields:
        assert spec.max_tp_shards == 1
    else:
        # an engine without the field can only mean "one shard": anything else is refused, not dropped
        with pytest.raises(TypeError, match="max_tp_shards"):
            compat.mla_attention_spec(block_size=16, num_kv_heads=1, max_tp_shards=2, head_size=96, dtype=torch.float32)
    with pytest.raises(TypeError, match="no_such_field"):
        compat.mla_attention_spec(block_size=16, num_kv_heads=1, head_size=96, dtype=torch.float32, no_such_field=1)


def test_weights_mapper_fn_maps_and_drops():
    from vllm.model_executor.models.utils import WeightsMapper

    mapper = WeightsMapper(orig_to_new_prefix={"model.": "language_model.model.", "mtp.": None})
    fn = compat.weights_mapper_fn(mapper)
    assert fn("model.layers.0.self_attn.q_proj.weight") == "language_model.model.layers.0.self_attn.q_proj.weight"
    assert fn("mtp.layers.0.weight") is None
    assert fn("lm_head.weight") == "lm_head.weight"


def test_installed_engine_is_in_the_tested_range():
    version = compat.engine_version()
    assert version is not None, "the tests run on a real vLLM"
    assert compat.engine_in_range(version), f"{version} outside {compat.ENGINE_RANGE}"
