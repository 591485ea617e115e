"""bfloat16 served logits against a bfloat16 reference: the checks every adapter's bf16 gate shares.

Each sequence is a dict ``{"served", "r16", "r32", "prompt_len", "gen"}``: the served bf16 logits,
the reference's bf16 and float32 logits at the same positions, the prompt length and the served
greedy tokens. ``E`` = max |r16 - r32| is the reference's own bf16 rounding on these inputs; two
bf16 implementations of the same math each sit within about E of the exact values, so a served
position may differ from r16 by up to 2 E. Discrete choices (top-k routing, DSA top-k) can flip
where two candidates are nearer than that; positions after such a near-tie may differ by more.
"""

from __future__ import annotations

import itertools
from functools import partial

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
    """``E`` (the reference's bf16 rounding), ``E_S`` (the served model's: max |served - float32
    reference|) and ``scale`` (max |float32 logit|) over the sequences."""
    return {
        "per_seq": per_seq,
        "E": max(float((p["r16"] - p["r32"]).abs().max()) for p in per_seq),
        "E_S": max(float((p["served"] - p["r32"]).abs().max()) for p in per_seq),
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
    vs32 = continuous["E_S"]
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


def decision_near_ties(decisions16: list[dict], decisions32: list[dict], n: int) -> dict:
    """Where the top-k decisions of the bfloat16 reference may go the other way, per decision and position.

    ``decisions16`` / ``decisions32``: the same decisions, in the same order, hooked in the bfloat16 and the
    float32 reference run, each ``{"scores": [n, C], "valid": [n, C] bool (the candidates), "k": int}``
    (a position with no more than k candidates decides nothing). ``E_d`` = max |bf16 score - fp32 score|
    over a position's candidates is the reference's own rounding of those scores; a second bfloat16
    implementation's scores sit within ``E_d`` of the float32 ones too, so its score of each candidate is
    within ``2 E_d`` of the bfloat16 reference's, and it can choose a rejected candidate over a chosen
    one only where the reference's scores of the two are at most ``4 E_d`` apart.

    Returns ``{"near_tie": [D, n] bool, "gap": [D, n], "limit": [D, n], "swaps": {(d, t): {(i, j): {"gap",
    "limit"}}}}``: ``gap`` between the last chosen and the first rejected score (inf where nothing is
    decided), ``limit`` = 4 E_d, and per near-tie the swaps that may happen, as ranks in the reference's
    order (chosen rank i < k <= rejected rank j, their scores ``gap`` <= ``limit`` apart).
    """
    if len(decisions16) != len(decisions32):
        raise AssertionError(f"{len(decisions16)} bf16 decisions vs {len(decisions32)} fp32 decisions")
    gaps = torch.full((len(decisions16), n), float("inf"))
    limits = torch.zeros((len(decisions16), n))
    swaps = {}
    for d, (d16, d32) in enumerate(zip(decisions16, decisions32)):
        s16, s32, valid, k = d16["scores"].float(), d32["scores"].float(), d16["valid"], d16["k"]
        if s16.shape[-1] <= k:  # no position has more than k candidates: nothing is decided
            continue
        e = torch.where(valid, (s16 - s32).abs(), 0.0).amax(-1)
        v = torch.where(valid, s16, float("-inf")).sort(-1, descending=True).values
        gap = torch.where(valid.sum(-1) > k, v[:, k - 1] - v[:, k], float("inf"))
        m = min(n, gap.shape[0])
        gaps[d, :m], limits[d, :m] = gap[:m], 4 * e[:m]
        for t in (gaps[d, :m] <= limits[d, :m]).nonzero().flatten().tolist():
            row, lim = v[t], float(limits[d, t])
            swaps[(d, t)] = {(i, j): {"gap": float(row[i] - row[j]), "limit": lim}
                             for i in range(k - 1, -1, -1) if float(row[i] - row[k]) <= lim
                             for j in range(k, int(valid[t].sum())) if float(row[i] - row[j]) <= lim}  # fmt: skip
    return {"near_tie": gaps <= limits, "gap": gaps, "limit": limits, "swaps": swaps}


def following_reference(forward16, forward32, n: int, unforced=None):
    """``follow_near_ties``' ``reference`` from the bfloat16 and float32 forwards of one sequence, each
    ``forced -> (logits [n, V], decisions)`` with the hooked decisions in call order; ``unforced``:
    their two results with nothing forced, where already run (the follower's first round reuses them)."""

    def run(forced, ties):
        if not forced and unforced is not None:
            (r16, decisions16), (_, decisions32) = unforced
        else:
            r16, decisions16 = forward16(forced)
            decisions32 = forward32(forced)[1] if ties else None
        return r16, (decision_near_ties(decisions16, decisions32, n) if ties else None)

    return run


def following_references(served, forward, m16, m32) -> tuple[list[dict], list]:
    """The served sequences (``parity.SeqLogits``) paired with the reference (``paired_sequences``) and
    each one's ``following_reference``, from the bfloat16 and float32 reference models ``m16``, ``m32``
    and ``forward(model, ids, forced) -> (logits [n, V], decisions)`` (the hooked decisions in call
    order, each ``(d, t, i, j)`` in ``forced`` taken the other way). Each model's unforced forward of a
    sequence runs once, for the pairing and the follower's first round."""
    unforced = [(forward(m16, s.positions_ids, ()), forward(m32, s.positions_ids, ())) for s in served]
    per_seq = paired_sequences(served, [u16[0] for u16, _ in unforced], [u32[0] for _, u32 in unforced])
    references = [
        following_reference(partial(forward, m16, s.positions_ids), partial(forward, m32, s.positions_ids),
                            len(s.positions_ids), unforced=u)
        for s, u in zip(served, unforced)
    ]  # fmt: skip
    return per_seq, references


def follow_near_ties(served, bound: float, reference, max_tries: int = 6000) -> dict:
    """Compare every position of one sequence, following the served model through near-tie decisions.

    ``reference(forced, ties)``: the reference logits ``[n, V]`` with every ``(decision, position, i, j)``
    in ``forced`` taken the other way (for a top-k decision the candidates of ranks i and j in the
    reference's order swapped: rank i < k rejected, rank j >= k chosen; ``w8a8_reference`` keys an
    int8 rounding the same way), and with ``ties`` also its ``decision_near_ties`` (else None).

    Where the first position beyond ``bound`` appears, a near-tie decision at or before it may have
    gone the other way in the served model, which changes every later position. Swaps that
    ``decision_near_ties`` allows are forced in the reference, at most ``max_tries`` of them: at the
    deviating position one swap in each of 1, 2, ... of its decisions, then two swaps in one decision,
    then each swap at an earlier position (latest first); the first that moves the first deviation
    later is kept, as the served model's choice, and the comparison continues from the forced
    reference. Where none does (the served model took two such decisions at different positions),
    the single swap that brings that deviation closest to ``bound`` is kept and the search goes on.
    Every kept swap is a decision that may go either way, so whichever set ends with every position
    within ``bound`` shows the served model equal to the reference up to such decisions. It ends
    there (all compared; each round keeps one more decision, so it ends), or at a deviation no swap
    moves or brings closer; ``compared`` counts the positions before it.
    """
    n = served.shape[0]
    forced: list[tuple[int, int, int, int]] = []
    flips: list[dict] = []
    while True:
        r16, ties = reference(tuple(forced), True)
        dev = (served - r16).abs().amax(-1)
        over = (dev > bound).nonzero().flatten()
        if not len(over):
            return {"compared": n, "flips": flips, "first_unexplained": None, "max_abs_diff": float(dev.max())}
        first = int(over[0])
        decided = {(f[0], f[1]) for f in forced}
        candidates = sorted(
            ((d, t, i, j) for (d, t), pairs in ties["swaps"].items() if t <= first and (d, t) not in decided
             for i, j in pairs),
            key=lambda c: (-c[1], c[0], c[2] - c[3]),
        )  # fmt: skip
        here: dict[int, list] = {}
        for c in candidates:
            if c[1] == first:
                here.setdefault(c[0], []).append(c)
        at_first = (
            combo
            for size in range(1, len(here) + 1)
            for decisions in itertools.combinations(here.values(), size)
            for combo in itertools.product(*decisions)
        )  # one swap in each of 1, 2, ... decisions there
        twice = ((a, b) for cs in here.values() for a in cs for b in cs if a[2] < b[2] and a[3] != b[3])
        earlier = ((c,) for c in candidates if c[1] < first)
        tries = list(itertools.islice(itertools.chain(at_first, twice, earlier), max_tries))
        moved, closer = None, (float(dev[first]), None)
        for flip in tries:
            r, _ = reference((*forced, *flip), False)
            dev_r = (served - r).abs().amax(-1)
            later = (dev_r > bound).nonzero().flatten()
            if not len(later) or int(later[0]) > first:
                moved = flip
                break
            if len(flip) == 1 and int(later[0]) == first and float(dev_r[first]) < closer[0]:
                closer = (float(dev_r[first]), flip)
        moved = moved or closer[1]  # none moves it: keep the one that brings the deviation closest, go on
        if moved is None:
            return {"compared": first, "flips": flips, "first_unexplained": first,
                    "deviation_there": float(dev[first]), "swaps_tried": len(tries),
                    "max_abs_diff": float(dev[:first].max()) if first else None}  # fmt: skip
        for d, t, i, j in moved:
            forced.append((d, t, i, j))
            flips.append({"decision": d, "position": t, "swap": [i, j], "deviation_before": float(dev[first]),
                          "at": first, **ties["swaps"][(d, t)][(i, j)]})  # fmt: skip


def check_discrete(rec, continuous: dict, per_seq, references, min_compared: int) -> bool:
    """Every position of every sequence within E + E_S of the reference that follows the served model
    through near-tie decisions (``follow_near_ties``), and at least ``min_compared`` positions
    compared; recorded in ``rec``.

    The bound, from ``continuous`` (the same weights with every choice total): the bf16 reference is
    within E of the float32 one and the served model within E_S of it (each measured there; the
    continuous check holds E_S <= 3 E), so the two are within E + E_S (triangle inequality).

    ``references[i]``: the ``reference`` callable of sequence i. The reference runs on the served token
    ids (prompt and generated), so a greedy divergence needs no forcing: the reference is fed the
    served tokens (teacher forcing); a flipped internal decision is followed by forcing it.
    """
    bound = continuous["E"] + continuous["E_S"]
    rows, compared = [], 0
    for p, reference in zip(per_seq, references):
        n = p["r16"].shape[0]
        row = {
            "prompt_len": p["prompt_len"],
            "positions": n,
            **follow_near_ties(p["served"], bound, reference),
        }
        row["ok"] = row["first_unexplained"] is None
        compared += row["compared"]
        rows.append(row)
    ok_all = all(r["ok"] for r in rows)
    rec.metric("E_and_E_S_from_continuous", [continuous["E"], continuous["E_S"]])
    rec.metric("bound_E_plus_E_S", bound)
    rec.metric("per_sequence", rows)
    rec.metric("positions_compared", compared)
    rec.metric("flips_followed", sum(len(r["flips"]) for r in rows))
    rec.metric("greedy_divergences", greedy_divergences(per_seq, bound))
    rec.check(
        f"in every sequence every position within E + E_S = {bound:.4g}, the reference following the near-tie decisions "
        "(gap <= 4 E_d) that the served model took the other way",
        ok_all,
        rows,
    )
    ok_n = rec.check(
        f"at least {min_compared} positions compared",
        compared >= min_compared,
        {"compared": compared, "required": min_compared},
    )
    print(f"discrete: bound {bound:.4g}, compared {compared}: {rows}")
    return ok_all and ok_n
