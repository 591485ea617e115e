"""Memory arithmetic for DeepSeek-V4-Flash (docs/models/deepseek_v4.md takes its table from here)."""

from __future__ import annotations

import pytest

from ascend_adapters.deepseek_v4 import memory as M


def test_flash_parameter_count_matches_the_published_284b():
    # The release is announced as 284B parameters; the per-module count from the config must land
    # there (vocabulary assumed 129280, ~1B of it), within 1%.
    total = sum(M.parameter_counts(M.flash_config()).values())
    assert abs(total - 284e9) < 0.01 * 284e9, total


def test_request_caches_follow_the_published_shape():
    """Flash: 2 sliding, 21 CSA (rate 4), 20 HCA (rate 128) layers; head_dim 512, indexer keys 128, window 128;
    bf16. A CSA compressor's state row is its KV projection and gate, 2 x 512 each for the two windows a position
    feeds (2048); the indexer's 4 x 128 (512). An HCA compressor's is its window's summary at the position, 512
    pooled values and 512 log-denominators, float32, for the last 2 positions, 8 positions a block.

    Full caches span 128 positions a block: a CSA layer's 32 entries of 512 and 32 indexer keys of 128, an HCA
    layer's one entry of 512. Model-dtype sliding caches hold 8 rows of lcm(512, 2048, 512) = 2048 values a
    block: the window 32 positions, the CSA state 8, the indexer state 32. vLLM keeps every full cache in one
    group and splits the 43 window caches into two groups of 22 and 21 (43 x 32 KiB exceed the full group's 860
    KiB); the 20 HCA summary caches are one group (20 x 32 KiB); a block id spans every group's pages, so each
    block a group holds costs the full group's bytes."""
    cfg = M.flash_config()
    slab = (21 * 32 * 512 + 21 * 32 * 128 + 20 * 1 * 512) * 2
    groups, got = M.cache_groups(cfg, cfg.layer_types, 2)
    assert got == slab == 880640
    assert M.hit_tokens(cfg) == 128

    def blocks(n, per_block, window=None):  # the blocks holding positions [n - window, n) or [0, n)
        first = 0 if window is None else max(0, n - window)
        return (n - 1) // per_block - first // per_block + 1

    for n in (100, 4096, 1048576):
        held = blocks(n, 128) + 2 * blocks(n, 32, 128) + blocks(n, 8, 8) + blocks(n, 32, 8) + blocks(n, 8, 2)
        assert M.request_cache_bytes(cfg, n) == held * slab, n


def _vllm_groups(config, dtype, stage=None, eight_bit=False):
    """vLLM's own grouping (``kv_cache_utils.get_kv_cache_groups``) of the specs the attention layers declare,
    with the block-outermost layout the backend asks for, projected onto a pipeline stage's layers ``[start,
    end)`` as vLLM does (``_project_kv_cache_groups_to_worker``); per group with caches there, (block size,
    its decoder layers, its pages' bytes)."""
    import types

    from vllm.v1.core import kv_cache_utils

    from ascend_adapters.common import compat

    specs = {
        f"model.layers.{i}.attn.{kind}_cache": g.kv_cache_spec(dtype)
        for i, t in enumerate(config.layer_types)
        for kind, g in M.layer_caches(config, t, eight_bit).items()
    }
    layouts = compat.block_outermost_kv_cache_layouts()
    vllm_config = types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        speculative_config=None,
        model_config=None,
        kv_transfer_config=None,
        attention_config=types.SimpleNamespace(hisparse_config=None),
        cache_config=types.SimpleNamespace(get_resolved_kv_cache_layout=lambda: layouts[0] if layouts else None),
    )
    groups = kv_cache_utils.get_kv_cache_groups(vllm_config, specs)
    assert sum(len(g.layer_names) for g in groups) == len(specs)
    if stage is not None:
        own = {n: s for n, s in specs.items() if stage[0] <= int(n.split(".")[2]) < stage[1]}
        groups = kv_cache_utils._project_kv_cache_groups_to_worker(groups, own)
    out = []
    for g in groups:
        if g.layer_names:
            layers = tuple(int(n.split(".")[2]) for n in g.layer_names)
            out.append((g.kv_cache_spec.block_size, layers, sum(specs[n].page_size_bytes for n in g.layer_names)))
    return sorted(out)


@pytest.mark.parametrize("cache", ["model_dtype", "8bit"])
@pytest.mark.parametrize("shape", ["flash", "tiny", "tiny_hca128"])
@pytest.mark.parametrize("stage", ["whole", "first_half", "second_half"])
def test_cache_groups_are_vllms(shape, stage, cache):
    """memory.cache_groups states how the installed vLLM groups the caches, whole and projected onto either
    half of a 2-stage pipeline, in the model dtype and with --kv-cache-dtype fp8 (window, entries and indexer
    keys 8-bit): the same groups of the same layers, and a block id's bytes the largest group's pages (the
    full caches)."""
    import torch

    from ascend_adapters.deepseek_v4.tiny import tiny_config

    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    config = {
        "flash": M.flash_config,
        "tiny": tiny_config,
        "tiny_hca128": lambda: tiny_config(compress_rates=rates),
    }[shape]()
    n = len(config.layer_types)
    layers = {"whole": None, "first_half": (0, n // 2), "second_half": (n // 2, n)}[stage]
    eight_bit = cache == "8bit"
    got = _vllm_groups(config, torch.bfloat16, layers, eight_bit)
    groups, slab = M.cache_groups(config, config.layer_types, 2, stage=layers, eight_bit=eight_bit)
    assert got == sorted((g.geometry.block_size, g.layers, g.page_bytes) for g in groups)
    assert max(page for _, _, page in got) == slab
    assert M.hit_tokens(config) == 128


def test_request_caches_grow_with_the_request_not_max_model_len():
    cfg = M.flash_config()
    sizes = [M.request_cache_bytes(cfg, n) for n in (1, 100, 4096, 131072, 1048576)]
    assert sizes == sorted(sizes) and sizes[-1] > 100 * sizes[1]
    # at 1M tokens the compressed entries and indexer keys dominate: one 512 + 128 value pair per 4 tokens
    # in 21 layers, one 512-value entry per 128 tokens in 20, bf16
    entries = (21 * (1048576 // 4) * (512 + 128) + 20 * (1048576 // 128) * 512) * 2
    assert entries < sizes[-1] < 1.01 * entries + sizes[1]


def test_concurrency_table_shrinks_with_length():
    rows = M.flash_table()
    conc = [r["concurrency"] for r in rows]
    assert conc == sorted(conc, reverse=True) and conc[0] > conc[-1]
    w = M.weight_bytes_per_device(M.flash_config(), 16, 16)
    for r in rows:  # the reported concurrency is the largest count that fits
        free = (64 << 30) - w
        assert r["concurrency"] * r["request_cache_bytes"] <= free < (r["concurrency"] + 1) * r["request_cache_bytes"]


def test_status_prints_the_memory_lines():
    """``ascend-adapters status`` (the installed adapter's hook, STATUS_NOTES) prints memory.py's lines."""
    import os
    import subprocess
    import sys

    env = {**os.environ}
    env.pop("ASCEND_ADAPTERS_DEEPSEEK_V4", None)  # default: the adapter serves it on CPU
    out = subprocess.run(
        [sys.executable, "-m", "ascend_adapters.common.cli", "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    block = text[text.index("  DeepseekV4ForCausalLM: adapter") :].splitlines()
    notes = M.status_notes()
    assert block[1].startswith("    pipeline parallelism: "), text  # the adapter's capabilities lines
    assert block[2].startswith("    graph mode: "), text
    assert block[3 : 3 + len(notes)] == [f"    {line}" for line in notes], text
    for r, line in zip(M.flash_table(), notes[1:]):
        assert f" {r['concurrency']} request(s) per device" in line, line
