"""The bf16 gates' shared checks (``testing.bf16``) on a synthetic model whose decisions are known.

The "model" has one top-1 decision per position among three candidates; its logits at position t are
a sum over positions s <= t of the chosen candidate's vector (a later position sees every earlier
choice, as attention does). A served run is the same model with some choices taken the other way.
"""

from __future__ import annotations

import torch

from ascend_adapters.testing.bf16 import decision_near_ties, follow_near_ties, following_references
from ascend_adapters.testing.parity import SeqLogits

N, C, V = 12, 3, 16
BOUND = 0.5
g = torch.Generator().manual_seed(0)
VECTORS = torch.randn(N, C, V, generator=g) * 4  # a flipped choice moves the logits far beyond BOUND
SCORES16 = torch.tensor([[1.0, 0.5, 0.0]] * N)
SCORES16[4] = torch.tensor([1.0, 0.99, 0.0])  # near-tie at 4: 0.01 apart
SCORES16[8] = torch.tensor([1.0, 0.995, 0.99])  # near-tie at 8 with both rejected candidates
SCORES32 = SCORES16 + 0.01  # every score rounded by 0.01: E_d = 0.01, 4 E_d = 0.04


def _logits(choice: list[int]) -> torch.Tensor:
    chosen = VECTORS[torch.arange(N), torch.tensor(choice)]
    return chosen.cumsum(0)


def _reference(forced, ties):
    choice = [0] * N
    for d, t, i, j in forced:
        assert d == 0 and i == 0
        choice[t] = j  # ranks are candidate indices here: the scores are sorted
    dec = lambda s: [{"scores": s, "valid": torch.ones(N, C, dtype=torch.bool), "k": 1}]  # noqa: E731
    return _logits(choice), decision_near_ties(dec(SCORES16), dec(SCORES32), N) if ties else None


def test_near_ties_and_their_swaps():
    ties = _reference((), True)[1]
    assert ties["near_tie"][0].nonzero().flatten().tolist() == [4, 8]
    assert set(ties["swaps"][(0, 4)]) == {(0, 1)}
    assert set(ties["swaps"][(0, 8)]) == {(0, 1), (0, 2)}


def test_follows_flips_at_near_ties():
    served = _logits([0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0])
    out = follow_near_ties(served, BOUND, _reference)
    assert out["first_unexplained"] is None and out["compared"] == N
    assert [(f["position"], f["swap"]) for f in out["flips"]] == [(4, [0, 1]), (8, [0, 2])]


def test_a_flip_where_no_near_tie_is_not_explained():
    served = _logits([0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0])  # position 6 is 0.5 apart: not within 4 E_d
    out = follow_near_ties(served, BOUND, _reference)
    assert out["first_unexplained"] == 6 and out["compared"] == 6


def test_a_deviation_no_decision_explains():
    served = _logits([0] * N)
    served[3] += 1.0  # not a choice at all
    out = follow_near_ties(served, BOUND, _reference)
    assert out["first_unexplained"] == 3 and out["flips"] == []


def test_following_references_reuse_the_unforced_forwards():
    """The gates' pairing and follower from one ``forward``: each model's unforced forward runs once,
    and the follower takes the same flips as from a reference that runs every forward."""
    calls = []

    def forward(model, ids, forced):
        assert len(ids) == N
        calls.append((model, tuple(forced)))
        scores, shift = (SCORES16, 0.0) if model == "m16" else (SCORES32, 0.001)
        decisions = [{"scores": scores, "valid": torch.ones(N, C, dtype=torch.bool), "k": 1}]
        return _reference(forced, False)[0] + shift, decisions

    choice = [0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0]
    served = SeqLogits(prompt_ids=list(range(8)), gen_ids=[1, 2, 3, 4, 5], logits=_logits(choice))
    per_seq, (reference,) = following_references([served], forward, "m16", "m32")
    assert calls == [("m16", ()), ("m32", ())]
    assert torch.equal(per_seq[0]["r16"], _logits([0] * N)) and per_seq[0]["prompt_len"] == 8
    out = follow_near_ties(per_seq[0]["served"], BOUND, reference)
    assert out == follow_near_ties(_logits(choice), BOUND, _reference)
    assert [(f["position"], f["swap"]) for f in out["flips"]] == [(4, [0, 1]), (8, [0, 2])]
    assert ("m16", ()) not in calls[2:] and ("m32", ()) not in calls[2:]  # the first round reused them
