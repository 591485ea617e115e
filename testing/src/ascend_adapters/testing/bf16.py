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


def decision_near_ties(decisions16: list[dict], decisions32: list[dict], n: int) -> torch.Tensor:
    """Per position, whether any top-k decision of the bfloat16 reference is a near-tie.

    ``decisions16`` / ``decisions32``: the same decisions, in the same order, hooked in the bfloat16 and the
    float32 reference run, each ``{"scores": [n, C], "valid": [n, C] bool (the candidates), "k": int}``
    (a position with no more than k candidates decides nothing). ``E_d`` = max |bf16 score - fp32 score|
    over a position's candidates is the reference's own rounding of those scores; a second bfloat16
    implementation's scores sit within ``E_d`` of the float32 ones too, so its score of each candidate is
    within ``2 E_d`` of the bfloat16 reference's, and a choice can differ only where the gap between the
    last chosen and the first rejected score is at most ``4 E_d``.
    """
    tie = torch.zeros(n, dtype=torch.bool)
    if len(decisions16) != len(decisions32):
        raise AssertionError(f"{len(decisions16)} bf16 decisions vs {len(decisions32)} fp32 decisions")
    for d16, d32 in zip(decisions16, decisions32):
        s16, s32, valid, k = d16["scores"].float(), d32["scores"].float(), d16["valid"], d16["k"]
        if s16.shape[-1] <= k:  # no position has more than k candidates: nothing is decided
            continue
        e = torch.where(valid, (s16 - s32).abs(), 0.0).amax(-1)
        v = torch.where(valid, s16, float("-inf")).sort(-1, descending=True).values
        gap = torch.where(valid.sum(-1) > k, v[:, k - 1] - v[:, k], float("inf"))
        m = min(n, gap.shape[0])
        tie[:m] |= gap[:m] <= 4 * e[:m]
    return tie


def check_discrete(rec, continuous: dict, per_seq, near_ties, min_compared: int) -> bool:
    """No position beyond 2 E before the first near-tie decision of its sequence, and at least
    ``min_compared`` positions compared that way over all sequences; recorded in ``rec``.

    ``near_ties[i]``: ``decision_near_ties`` of sequence i. The reference runs on the served token ids
    (prompt and generated), so a position after a greedy divergence is still compared on the same
    inputs; only a discrete choice that may flip ends a sequence's comparison.
    """
    bound = 2 * continuous["E"]
    rows, ok_all, compared = [], True, 0
    for p, tie in zip(per_seq, near_ties):
        n = p["r16"].shape[0]
        dev = (p["served"] - p["r16"]).abs().amax(-1)
        tie = tie[:n]
        first_tie = int(tie.nonzero()[0]) if tie.any() else n
        over = (dev > bound).nonzero().flatten().tolist()
        first_over = over[0] if over else None
        ok = first_over is None or first_over >= first_tie
        ok_all &= ok
        compared += first_tie
        rows.append({"prompt_len": p["prompt_len"], "positions": n, "positions_within_2E": n - len(over),
                     "compared_before_first_near_tie": first_tie, "first_over": first_over,
                     "near_tie_positions": int(tie.sum()), "max_abs_diff": float(dev.max()),
                     "max_abs_diff_before_first_near_tie": float(dev[:first_tie].max()) if first_tie else None,
                     "ok": ok})  # fmt: skip
    rec.metric("bound_2E_from_continuous", bound)
    rec.metric("per_sequence", rows)
    rec.metric("positions_compared", compared)
    rec.metric("greedy_divergences", greedy_divergences(per_seq, bound))
    rec.check("in every sequence, no position beyond 2 E before the first near-tie decision", ok_all, rows)
    ok_n = rec.check(
        f"at least {min_compared} positions compared before their sequence's first near-tie",
        compared >= min_compared,
        {"compared": compared, "required": min_compared},
    )
    print(f"discrete: bound {bound:.4g}, compared {compared}: {rows}")
    return ok_all and ok_n
