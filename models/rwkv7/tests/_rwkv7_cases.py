"""Shared tiny checkpoints for the rwkv7 tests (BlinkDL .pth -> converter -> HF dir)."""

from __future__ import annotations

import random
from pathlib import Path

from ascend_adapters.rwkv7.convert import convert
from ascend_adapters.rwkv7.tiny import blinkdl_state_dict, write_pth

# name -> shape; head size 64 as released models, and a smaller one with another head count
CASES = {
    "h64x2_l3": {"n_layer": 3, "n_embd": 128, "head_size": 64, "vocab": 1024, "seed": 1},
    "h32x3_l2": {"n_layer": 2, "n_embd": 96, "head_size": 32, "vocab": 1024, "seed": 2},
}


def build_case(root: Path, name: str) -> tuple[Path, Path]:
    """(source .pth, converted HF dir)."""
    spec = CASES[name]
    pth = write_pth(root / f"{name}.pth", blinkdl_state_dict(**spec))
    out = convert(pth, root / name, log=lambda *_: None)
    return pth, out


def prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]
