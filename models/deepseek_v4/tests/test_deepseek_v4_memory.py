"""Memory arithmetic for DeepSeek-V4-Flash (docs/models/deepseek_v4.md takes its table from here)."""

from __future__ import annotations

from ascend_adapters.deepseek_v4 import memory as M


def test_flash_parameter_count_matches_the_published_284b():
    # The release is announced as 284B parameters; the per-module count from the config must land
    # there (vocabulary assumed 129280, ~1B of it), within 1%.
    total = sum(M.parameter_counts(M.flash_config()).values())
    assert abs(total - 284e9) < 0.01 * 284e9, total


def test_request_caches_follow_the_published_shape():
    """Flash: 2 sliding, 21 CSA (rate 4), 20 HCA (rate 128) layers; head_dim 512, hidden 4096, indexer keys
    128, window 128; bf16 pages of 16 x 4096 values. A CSA compressor's state row is its KV projection and
    gate, 2 x 512 each for the two windows a position feeds (2048); an HCA one's 2 x 512; the indexer's 4 x 128."""
    cfg = M.flash_config()
    page = 16 * 4096 * 2

    def blocks(n, per_block, window=None):  # the blocks holding positions [n - window, n) or [0, n)
        first = 0 if window is None else max(0, n - window)
        return (n - 1) // per_block - first // per_block + 1

    for n in (100, 4096, 1048576):
        window = blocks(n, 128, 128)  # 128 positions of 512 per page
        # compressor states (32 of 2048 per page) and indexer states (128 of 512) of the last 8 positions,
        # entries (128 of 512 per page, 4 positions each), indexer keys (512 of 128)
        csa = window + blocks(n, 32, 8) + blocks(n, 128, 8) + blocks(n, 4 * 128) + blocks(n, 4 * 512)
        hca = window + blocks(n, 64, 128) + blocks(n, 128 * 128)  # states (64 of 1024) of the last 128; entries
        assert M.request_cache_bytes(cfg, n) == (2 * window + 21 * csa + 20 * hca) * page, n


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
