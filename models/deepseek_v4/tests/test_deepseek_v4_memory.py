"""Memory arithmetic for DeepSeek-V4-Flash (docs/models/deepseek_v4.md takes its table from here)."""

from __future__ import annotations

from ascend_adapters.deepseek_v4 import memory as M


def test_flash_parameter_count_matches_the_published_284b():
    # The release is announced as 284B parameters; the per-module count from the config must land
    # there (vocabulary assumed 129280, ~1B of it), within 1%.
    total = sum(M.parameter_counts(M.flash_config()).values())
    assert abs(total - 284e9) < 0.01 * 284e9, total


def test_state_is_sized_for_max_model_len_in_every_layer():
    cfg = M.flash_config()
    for length in (4096, 1048576):
        # window [128, 512] + ring [2*4 vs 128 -> 128, 4096] + entries and indexer keys
        # [length/4 + 1, 512 + 128], float32, the same page in all 43 layers
        per_layer = 128 * 512 + 128 * 4096 + (length // 4 + 1) * (512 + 128)
        assert M.state_bytes_per_sequence(cfg, length) == 43 * per_layer * 4


def test_paged_state_depends_on_the_sequence_not_on_max_model_len():
    cfg = M.flash_config()
    short = M.paged_state_bytes(cfg, 100)
    assert short < M.state_bytes_per_sequence(cfg, 4096) / 5  # HCA rings (128 x hidden) dominate a short one
    assert M.paged_state_bytes(cfg, 1048576) < M.state_bytes_per_sequence(cfg, 1048576) / 3


def test_concurrency_table_shrinks_with_length():
    rows = M.flash_table()
    conc = [r["concurrency"] for r in rows]
    assert conc == sorted(conc, reverse=True) and conc[0] > conc[-1]
    w = M.weight_bytes_per_device(M.flash_config(), 16, 16)
    for r in rows:  # the reported concurrency is the largest count that fits
        free = (64 << 30) - w
        assert (
            r["concurrency"] * r["state_bytes_per_sequence"]
            <= free
            < (r["concurrency"] + 1) * r["state_bytes_per_sequence"]
        )


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
        assert f" {r['concurrency']} sequence(s) per device" in line, line
