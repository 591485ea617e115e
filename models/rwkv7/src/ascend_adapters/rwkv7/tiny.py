"""Tiny random RWKV-7 checkpoints in the BlinkDL ``.pth`` layout (the names and
shapes of real x070 checkpoints), and ``make_tiny`` which converts one into an
HF-layout directory vLLM can serve (used by tests, the bench and the demo).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

WORLD_VOCAB = 65536


def blinkdl_state_dict(
    n_layer: int = 2,
    n_embd: int = 64,
    head_size: int = 32,
    vocab: int = WORLD_VOCAB,
    ffn: int | None = None,
    ranks: dict | None = None,
    seed: int = 0,
) -> dict:
    """Random weights in BlinkDL x070 naming, scaled so that every part of the block matters."""
    import torch

    g = torch.Generator().manual_seed(seed)
    c, h, n = n_embd, n_embd // head_size, head_size
    ffn = ffn or 4 * c
    ranks = {"w": 16, "a": 16, "v": 8, "g": 32, **(ranks or {})}

    def rnd(*shape, std=1.0, mean=0.0):
        return torch.randn(*shape, generator=g) * std + mean

    def uni(*shape, lo=0.0, hi=1.0):
        return torch.rand(*shape, generator=g) * (hi - lo) + lo

    sd = {
        "emb.weight": rnd(vocab, c),
        "blocks.0.ln0.weight": rnd(c, std=0.1, mean=1.0),
        "blocks.0.ln0.bias": rnd(c, std=0.1),
    }
    for i in range(n_layer):
        p = f"blocks.{i}."
        sd[p + "ln1.weight"], sd[p + "ln1.bias"] = rnd(c, std=0.1, mean=1.0), rnd(c, std=0.1)
        sd[p + "ln2.weight"], sd[p + "ln2.bias"] = rnd(c, std=0.1, mean=1.0), rnd(c, std=0.1)
        for x in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            sd[p + "att." + x] = uni(1, 1, c)
        sd[p + "att.w0"] = rnd(1, 1, c, std=1.0, mean=-0.5)
        sd[p + "att.w1"], sd[p + "att.w2"] = rnd(c, ranks["w"], std=0.3), rnd(ranks["w"], c, std=0.3)
        sd[p + "att.a0"] = rnd(1, 1, c, std=0.5)
        sd[p + "att.a1"], sd[p + "att.a2"] = rnd(c, ranks["a"], std=0.3), rnd(ranks["a"], c, std=0.3)
        if i > 0:
            sd[p + "att.v0"] = rnd(1, 1, c, std=0.5, mean=0.5)
            sd[p + "att.v1"], sd[p + "att.v2"] = rnd(c, ranks["v"], std=0.3), rnd(ranks["v"], c, std=0.3)
        sd[p + "att.g1"], sd[p + "att.g2"] = rnd(c, ranks["g"], std=0.3), rnd(ranks["g"], c, std=0.3)
        sd[p + "att.k_k"] = uni(1, 1, c, lo=0.5, hi=1.0)
        sd[p + "att.k_a"] = uni(1, 1, c, lo=0.5, hi=1.5)
        sd[p + "att.r_k"] = rnd(h, n, std=0.3)
        for proj in ("receptance", "key", "value", "output"):
            sd[p + f"att.{proj}.weight"] = rnd(c, c, std=c**-0.5)
        sd[p + "att.ln_x.weight"], sd[p + "att.ln_x.bias"] = rnd(c, std=0.1, mean=1.0), rnd(c, std=0.1)
        sd[p + "ffn.x_k"] = uni(1, 1, c)
        sd[p + "ffn.key.weight"] = rnd(ffn, c, std=c**-0.5)
        sd[p + "ffn.value.weight"] = rnd(c, ffn, std=ffn**-0.5)
    sd["ln_out.weight"], sd["ln_out.bias"] = rnd(c, std=0.1, mean=1.0), rnd(c, std=0.1)
    sd["head.weight"] = rnd(vocab, c, std=2 * c**-0.5)
    return sd


def self_repeating(sd: dict, time_mix_scale: float = 0.05) -> dict:
    """``sd`` made to repeat itself, for speculative decoding (n-gram drafts need text that recurs).

    The channel-mix sees only the current token (``ffn.x_k`` = 0) and every time-mix output is scaled by
    ``time_mix_scale``: the next token is then almost a function of the current one, so greedy output
    falls into cycles that an n-gram proposer predicts. The recurrent state still moves the logits (by
    about ``time_mix_scale`` of their spread), so a draft is sometimes rejected, and a state rolled back
    to the wrong token shows in the logits.
    """
    out = dict(sd)
    for name, t in sd.items():
        if name.endswith("ffn.x_k"):
            out[name] = t * 0
        elif name.endswith("att.output.weight"):
            out[name] = t * time_mix_scale
    return out


def write_pth(path: str | Path, sd: dict) -> Path:
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(sd, str(path))
    return path


def make_tiny(
    out_dir: str | Path,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    head_size: int = 32,
    vocab: int = WORLD_VOCAB,
    seed: int = 0,
    pth: str | Path | None = None,
) -> Path:
    """Write a tiny random BlinkDL checkpoint and convert it into ``out_dir``; returns ``out_dir``.

    The vocabulary defaults to the World tokenizer's size so text prompts work.
    ``pth`` keeps the source ``.pth`` at that path (else it lives in a temp dir).
    """
    from ascend_adapters.rwkv7.convert import convert

    sd = blinkdl_state_dict(n_layer=n_layer, n_embd=n_embd, head_size=head_size, vocab=vocab, seed=seed)
    with tempfile.TemporaryDirectory() as tmp:
        src = write_pth(Path(pth) if pth else Path(tmp) / "tiny-rwkv7.pth", sd)
        return convert(src, out_dir, overwrite=True, log=lambda *_: None)
