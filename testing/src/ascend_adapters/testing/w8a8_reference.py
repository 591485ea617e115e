"""W8A8 references quantized here, from a float model, with ModelSlim's published equations.

docs/references.md#modelslim-w8a8-math: a weight is int8 per output channel, symmetric,
``s_w = max|W[n, :]| / 127``; a W8A8_DYNAMIC activation is int8 per token, symmetric,
``s_x = max|x[t, :]| / 127``; a static W8A8 activation is int8 per tensor, asymmetric, over the
calibrated range ``[lo, hi]`` (0 included): ``scale = (hi - lo) / 255``,
``offset = round(-128 - lo / scale)``. Then ``y = (x_q . W_q^T) * (s_x * s_w)``, the integer product
exact (float64 holds every int8 x int8 sum of these sizes), so only the float32 scaling and everything
outside the linears round.

Nothing here reads an exported tensor or calls the exporter (``testing.modelslim``) or the kernels
(``common.quant``): a test quantizes the float checkpoint the export was made from and compares the
served export with it, so an exporter, loader or kernel error shows.

A row-parallel linear under tensor parallelism quantizes the input slice its rank holds with that
slice's own per-token scale, and the ranks' partial outputs are summed: ``slices`` models that.

Quantization is discontinuous: where an activation sits within float32 error of an int8 rounding
boundary, two correct implementations may round it to neighbouring steps, and that step reaches the
logits (its position's and, through attention, later ones'). ``compare_within_rounding`` therefore
follows the served model through such roundings (``testing.bf16.follow_near_ties``, the follower the
bf16 gates use for top-k decisions): where a position deviates beyond the bound, the reference is run
again with a near-boundary rounding at or before it taken the other way, and the comparison goes on.
"""

from __future__ import annotations

import torch

from ascend_adapters.testing.bf16 import follow_near_ties

U = 2.0**-24  # float32 unit roundoff
# how a check compared with compare_within_rounding says so
FOLLOWING = "following the near-boundary int8 roundings the served model took the other way"


def symmetric_int8(t: torch.Tensor, slices: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)``: symmetric int8 per row (a weight's output channel, an activation's token) over each of
    ``slices`` equal slices of the last dim; ``q [..., slices, K / slices]`` integers, ``s [..., slices, 1]``."""
    ts = t.float().unflatten(-1, (slices, -1))
    s = ts.abs().amax(-1, keepdim=True) / 127.0
    s = torch.where(s > 0, s, 1.0)
    return torch.round(ts / s).clamp(-127, 127), s


class DynamicLinear(torch.nn.Module):
    """W8A8_DYNAMIC ``y = x W^T`` (no bias: ModelSlim's dynamic layers here have none)."""

    def __init__(self, weight: torch.Tensor, slices: int = 1):
        super().__init__()
        q, s = symmetric_int8(weight)
        self.wq = q[:, 0].double().unflatten(-1, (slices, -1))  # [N, R, K/R]
        self.ws = s[:, 0, 0]
        self.slices = slices

    def forward(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``rows``: the sequence position of each row of ``x`` where it is not every position in order."""
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = symmetric_int8(x2, self.slices)  # [T, R, K/R], [T, R, 1]
        if _roundings is not None:
            xq = _roundings.observe(x2.float().unflatten(-1, (self.slices, -1)) / xs, xq, rows, scale_error=True)
        acc = torch.einsum("trk,nrk->trn", xq.double(), self.wq).float()
        y = (acc * (xs * self.ws.reshape(1, 1, -1))).sum(1)  # each rank's output, then the all-reduce
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)


class StaticLinear(torch.nn.Module):
    """Static W8A8 ``y = x W^T``: one asymmetric int8 grid for the input over the calibrated [lo, hi]."""

    def __init__(self, weight: torch.Tensor, lo: float, hi: float):
        super().__init__()
        q, s = symmetric_int8(weight)
        self.wq, self.ws = q[:, 0].double(), s[:, 0, 0]
        lo, hi = min(lo, 0.0), max(hi, 0.0)
        self.scale = torch.tensor((hi - lo) / 255.0, dtype=torch.float32)
        self.offset = float(round(-128.0 - lo / float(self.scale)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = x.float() / self.scale + self.offset
        xq = torch.round(grid).clamp(-128, 127)
        if _roundings is not None:
            xq = _roundings.observe(grid.reshape(-1, 1, grid.shape[-1]), xq.reshape(-1, 1, grid.shape[-1]), None,
                                    scale_error=False).reshape(xq.shape)  # fmt: skip
        xq = xq - self.offset
        return ((xq.double() @ self.wq.t()).float() * (self.scale * self.ws)).to(x.dtype)


class DynamicExperts(torch.nn.Module):
    """transformers' routed-expert interface (``forward(hidden, top_k_index, top_k_weights)``) over its
    fused ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``, each projection W8A8_DYNAMIC per expert.

    ``gate``: ``gate_up -> down_proj input``; default ``act_fn(gate) * up`` (the two halves in that
    order), or the model's own (e.g. DeepSeek-V4's clamped SwiGLU, ``experts._apply_gate``).
    """

    def __init__(self, experts: torch.nn.Module, gate=None):
        super().__init__()
        self.num_experts = experts.num_experts
        self.act = experts.act_fn
        self.gate = gate
        self.gate_up = [DynamicLinear(w) for w in experts.gate_up_proj.detach()]
        self.down = [DynamicLinear(w) for w in experts.down_proj.detach()]

    def _gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.gate(gate_up)
        g, u = gate_up.chunk(2, dim=-1)
        return self.act(g) * u

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            y = self.down[e](self._gate(self.gate_up[e](hidden_states[tok], rows=tok)), rows=tok)
            out.index_add_(0, tok, y * top_k_weights[tok, pos, None])
        return out


def quantize_linear(parent: torch.nn.Module, name: str, slices: int = 1) -> None:
    """Replace ``parent.<name>`` (an ``nn.Linear`` without bias) by its W8A8_DYNAMIC reference."""
    linear = getattr(parent, name)
    if getattr(linear, "bias", None) is not None:
        raise ValueError(f"{name}: a W8A8_DYNAMIC reference linear with a bias is not written here")
    setattr(parent, name, DynamicLinear(linear.weight.detach(), slices))


# -- the bound ------------------------------------------------------------------------------------
class _Roundings:
    """Every activation quantization of one reference forward, in call order (a "decision" each), with the
    roundings ``forced`` taken to the other int8 neighbour.

    An activation ``x`` is the result of float32 reductions over about K terms (K its width: a norm over K,
    a projection into K), so two implementations' values of it differ by up to ``K u`` relative, and so
    does a per-token scale ``max|x| / 127``: the value rounded, ``x / s``, by up to ``2 K u`` of itself
    (``K u`` with a fixed static scale). A rounding is near its boundary where the distance of ``x / s``
    to the half-step is within that.
    """

    def __init__(self, forced):
        self.calls: list[dict] = []
        self.forced: dict[int, list[int]] = {}
        for d, _t, i, _j in forced:
            self.forced.setdefault(d, []).append(i)

    def observe(self, ratio, q, rows, *, scale_error: bool):
        """``ratio [T, R, C]``: the values rounded; ``q``: their roundings (returned, forced ones flipped)."""
        t, r, c = ratio.shape
        width = r * c
        rows = torch.arange(t) if rows is None else rows.reshape(-1)
        margin = (ratio - ratio.floor() - 0.5).abs().reshape(t, width)
        limit = ((2 if scale_error else 1) * width * U) * ratio.abs().reshape(t, width)
        d = len(self.calls)
        self.calls.append({"rows": rows, "margin": margin, "limit": limit, "width": width})
        if d not in self.forced:
            return q
        q = q.clone().reshape(t, width)
        flat = ratio.reshape(t, width)
        for i in self.forced[d]:
            row = int((rows == i // width).nonzero()[0])
            e = i % width
            q[row, e] += 1.0 if flat[row, e] > q[row, e] else -1.0  # the other neighbour of the value rounded
        return q.reshape(t, r, c)

    def near_boundary(self, n: int, first: int) -> dict:
        """``testing.bf16.decision_near_ties``' structure over the compared positions (position p of the
        sequence is ``p - first`` there; earlier ones count at 0). A swap key ``(i, j)``: ``i = p * width +
        element``, ``j = -1 - i`` (unused; distinct per rounding)."""
        gaps = torch.full((len(self.calls), n), float("inf"))
        limits = torch.zeros((len(self.calls), n))
        swaps: dict = {}
        for d, call in enumerate(self.calls):
            near = call["margin"] <= call["limit"]
            for row, e in near.nonzero().tolist():
                p = int(call["rows"][row])
                t = min(max(p - first, 0), n - 1)
                m = float(call["margin"][row, e])
                i = p * call["width"] + e
                swaps.setdefault((d, t), {})[(i, -1 - i)] = {"gap": m, "limit": float(call["limit"][row, e])}
                if m < gaps[d, t]:
                    gaps[d, t], limits[d, t] = m, float(call["limit"][row, e])
        return {"near_tie": torch.isfinite(gaps), "gap": gaps, "limit": limits, "swaps": swaps}


_roundings: _Roundings | None = None


def compare_within_rounding(sequences, reference, tol: float) -> dict:
    """Served ``(prompt_ids, gen_ids, logits)`` against ``reference`` (``ids -> logits``, built from this
    module's linears) position by position within ``tol``, following the served model through
    near-boundary int8 roundings (module doc).

    ``logits`` covers the last ``len(logits)`` positions of ``prompt_ids + gen_ids[:-1]`` (every position
    for ``parity.vllm_logits``, the generated steps for ``engine_worker.engine_run``).
    """
    rows = []
    for prompt_ids, gen_ids, logits in sequences:
        ids = list(prompt_ids) + list(gen_ids[:-1])
        got = logits.float()
        n, first = got.shape[0], len(ids) - got.shape[0]

        def run(forced, ties, ids=ids, n=n, first=first, width=got.shape[-1]):
            global _roundings
            _roundings = _Roundings(forced)
            try:
                full = torch.as_tensor(reference(ids)).float()
                seen = _roundings
            finally:
                _roundings = None
            return full[first:, :width], (seen.near_boundary(n, first) if ties else None)

        want, _ = run((), False)
        out = follow_near_ties(got, tol, run)
        rows.append({"prompt_len": len(prompt_ids), "positions": n, **out,
                     "max_abs_diff_unfollowed": float((got - want).abs().max()),
                     "greedy_identical": want[-len(gen_ids):].argmax(-1).tolist() == list(gen_ids)})  # fmt: skip
    compared = sum(r["compared"] for r in rows)
    total = sum(r["positions"] for r in rows)
    return {"within_bound": compared == total, "positions_compared": compared, "positions": total,
            "roundings_followed": sum(len(r["flips"]) for r in rows),
            "tokens_identical": all(r["greedy_identical"] for r in rows),
            "max_abs_diff": max(r["max_abs_diff"] or 0.0 for r in rows), "per_sequence": rows}  # fmt: skip
