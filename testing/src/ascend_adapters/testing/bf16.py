"""bfloat16 served logits against a bfloat16 reference: the checks every adapter's bf16 gate shares.

Each sequence is a dict ``{"served", "r16", "r32", "prompt_len", "gen"}``: the served bf16 logits,
the reference's bf16 and float32 logits at the same positions, the prompt length and the served
greedy tokens. ``E`` = max |r16 - r32| is the reference's own bf16 rounding on these inputs; two
bf16 implementations of the same math each sit within about E of the exact values, so a served
position may differ from r16 by up to 2 E. Discrete choices (top-k routing, DSA top-k) can flip
where two candidates are nearer than that; positions after such a near-tie may differ by more.
"""

from __future__ import annotations

import torch


def paired_sequences(served, r16, r32) -> list[dict]:
    """Served sequences (``parity.SeqLogits``) with the reference logits at their positions."""
    out = []
    for s, a, b in zip(served, r16, r32):
        got = s.logits.float()[:, : a.shape[-1]]
        if got.shape != a.shape or not torch.isfinite(got).all():
            raise AssertionError(f"served logits {tuple(got.shape)} (finite: {bool(torch.isfinite(got).all())}) "
                                 f"vs reference {tuple(a.shape)}")  # fmt: skip
        out.append({"served": got, "r16": a, "r32": b, "prompt_len": len(s.prompt_ids), "gen": s.gen_ids})
    return out


def rounding_scale(per_seq) -> dict:
    """``E`` (the reference's bf16 rounding) and ``scale`` (max |float32 logit|) over the sequences."""
    return {
        "per_seq": per_seq,
        "E": max(float((p["r16"] - p["r32"]).abs().max()) for p in per_seq),
        "scale": max(float(p["r32"].abs().max()) for p in per_seq),
    }


def greedy_divergences(per_seq, bound: float) -> list[dict]:
    """The first generated step of each sequence where the served token is not the reference's argmax."""
    out = []
    for p in per_seq:
        t = p["prompt_len"]
        for j, tok in enumerate(p["gen"]):
            want = int(p["r16"][t - 1 + j].argmax())
            if tok != want:
                gap = float(p["r16"][t - 1 + j, want] - p["r16"][t - 1 + j, tok])
                out.append({"prompt_len": t, "step": j, "served": tok, "reference": want, "gap": gap,
                            "near_tie": gap <= bound})  # fmt: skip
                break  # later steps continue from the served token, still compared position by position
    return out


def check_continuous(rec, continuous: dict, lengths) -> bool:
    """Every position within 2 E, and greedy tokens equal or split at a near-tie; recorded in ``rec``."""
    E, bound = continuous["E"], 2 * continuous["E"]
    per_pos = torch.cat([(p["served"] - p["r16"]).abs().amax(-1) for p in continuous["per_seq"]])
    vs32 = max(float((p["served"] - p["r32"]).abs().max()) for p in continuous["per_seq"])
    ties = greedy_divergences(continuous["per_seq"], bound)
    rec.metric("prompt_lengths", list(lengths))
    rec.metric("positions", int(per_pos.numel()))
    rec.metric("transformers_bf16_vs_fp32_max_abs_diff_E", E)
    rec.metric("max_abs_logit_diff_vs_transformers_bf16", float(per_pos.max()))
    rec.metric("median_position_max_abs_diff", float(per_pos.median()))
    rec.metric("served_bf16_vs_transformers_fp32_max_abs_diff", vs32)
    rec.metric("max_abs_logit_fp32", continuous["scale"])
    rec.metric("greedy_divergences", ties)
    ok = rec.check(f"every position within 2 E = {bound:.4g}", float(per_pos.max()) <= bound,
                   {"positions_over": int((per_pos > bound).sum())})  # fmt: skip
    ok_t = rec.check(
        "greedy tokens identical or differ at a near-tie (top-2 gap <= 2 E)", all(t["near_tie"] for t in ties), ties
    )
    print(f"continuous: max {float(per_pos.max()):.4g} vs 2E {bound:.4g} (E {E:.4g}); vs fp32 {vs32:.4g}; {ties}")
    return ok and ok_t


def check_discrete(rec, continuous: dict, per_seq, near_tie_gaps) -> bool:
    """No position beyond 2 E before the first near-tie decision of its sequence; recorded in ``rec``.

    ``near_tie_gaps[i]`` lists, for sequence i, per-position relative decision gaps (one tensor per
    hooked decision); a gap <= 2 E / scale is a near-tie.
    """
    bound = 2 * continuous["E"]
    rel_tie = bound / continuous["scale"]
    rows, ok_all = [], True
    for p, gaps in zip(per_seq, near_tie_gaps):
        n = p["r16"].shape[0]
        dev = (p["served"] - p["r16"]).abs().amax(-1)
        tie = torch.zeros(n, dtype=torch.bool)
        for g in gaps:
            tie |= g[:n] <= rel_tie
        first_tie = int(tie.nonzero()[0]) if tie.any() else n
        over = (dev > bound).nonzero().flatten().tolist()
        first_over = over[0] if over else None
        ok = first_over is None or first_over >= first_tie
        ok_all &= ok
        rows.append({"prompt_len": p["prompt_len"], "positions": n, "positions_within_2E": n - len(over),
                     "first_over": first_over, "first_near_tie": first_tie, "near_tie_positions": int(tie.sum()),
                     "max_abs_diff": float(dev.max()), "ok": ok})  # fmt: skip
    rec.metric("bound_2E_from_continuous", bound)
    rec.metric("relative_near_tie_threshold", rel_tie)
    rec.metric("per_sequence", rows)
    rec.metric("greedy_divergences", greedy_divergences(per_seq, bound))
    rec.check("in every sequence, no position beyond 2 E before the first near-tie decision", ok_all, rows)
    print(f"discrete: bound {bound:.4g}, rel tie {rel_tie:.3g}: {rows}")
    return ok_all
