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

Dynamic quantization is discontinuous: where an activation sits within float32 rounding of an int8
rounding boundary, two correct implementations may round it to neighbouring steps, and that step
reaches the logits (its position's and, through attention, later ones'). ``compare_within_rounding``
measures that sensitivity on the reference itself and widens the bound only where it is present.
"""

from __future__ import annotations

import torch


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = symmetric_int8(x2, self.slices)  # [T, R, K/R], [T, R, 1]
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
        xq = torch.round(x.float() / self.scale + self.offset).clamp(-128, 127) - self.offset
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
            y = self.down[e](self._gate(self.gate_up[e](hidden_states[tok])))
            out.index_add_(0, tok, y * top_k_weights[tok, pos, None])
        return out


def quantize_linear(parent: torch.nn.Module, name: str, slices: int = 1) -> None:
    """Replace ``parent.<name>`` (an ``nn.Linear`` without bias) by its W8A8_DYNAMIC reference."""
    linear = getattr(parent, name)
    if getattr(linear, "bias", None) is not None:
        raise ValueError(f"{name}: a W8A8_DYNAMIC reference linear with a bias is not written here")
    setattr(parent, name, DynamicLinear(linear.weight.detach(), slices))


# -- the bound ------------------------------------------------------------------------------------
# S(t): every decoder layer's output multiplied by (1 + 2^-23 n), n standard normal (one float32
# rounding of the residual sum), in DRAWS independent draws; S(t) = the largest logit change at
# position t. Served and reference are two such perturbations of the same math, so
# |served - reference| <= tol + 2 S(t); positions the noise never moves keep tol.
ROUNDING_REL = 2.0**-23
DRAWS = 4


def rounding_sensitivity(reference, layers, ids: list[int], base: torch.Tensor | None = None) -> torch.Tensor:
    """S(t) per position of ``ids``: ``reference(ids) -> logits``; ``layers``: the modules perturbed;
    ``base``: ``reference(ids)`` where the caller already has it."""
    if base is None:
        base = torch.as_tensor(reference(ids)).float()
    gen = torch.Generator().manual_seed(0)

    def perturb(module, args, out):
        h = out[0] if isinstance(out, tuple) else out
        h = h * (1 + ROUNDING_REL * torch.randn(h.shape, generator=gen, dtype=h.dtype))
        return (h, *out[1:]) if isinstance(out, tuple) else h

    worst = torch.zeros(len(ids))
    for _ in range(DRAWS):
        hooks = [layer.register_forward_hook(perturb) for layer in layers]
        try:
            worst = torch.maximum(worst, (torch.as_tensor(reference(ids)).float() - base).abs().amax(-1))
        finally:
            for h in hooks:
                h.remove()
    return worst


def compare_within_rounding(sequences, reference, layers, tol: float) -> dict:
    """Served ``(prompt_ids, gen_ids, logits)`` against ``reference`` position by position within
    ``tol + 2 S(t)``; at least half of all positions must have S <= tol (the bound still compares).

    ``logits`` covers the last ``len(logits)`` positions of ``prompt_ids + gen_ids[:-1]`` (every position
    for ``parity.vllm_logits``, the generated steps for ``engine_worker.engine_run``).
    """
    rows = []
    for prompt_ids, gen_ids, logits in sequences:
        ids = list(prompt_ids) + list(gen_ids[:-1])
        first = len(ids) - logits.shape[0]
        got = logits.float()
        full = torch.as_tensor(reference(ids)).float()
        want = full[first:, : got.shape[-1]]
        diff = (got - want).abs().amax(-1)
        sens = rounding_sensitivity(reference, layers, ids, base=full)[first:]
        calm = sens <= tol
        rows.append({"prompt_len": len(prompt_ids), "positions": len(diff), "max_abs_diff": float(diff.max()),
                     "rounding_sensitive_positions": int((~calm).sum()), "max_sensitivity": float(sens.max()),
                     "max_abs_diff_where_insensitive": float(diff[calm].max()) if calm.any() else None,
                     "positions_over_bound": (first + (diff > tol + 2 * sens).nonzero().flatten()).tolist(),
                     "greedy_identical": want[-len(gen_ids):].argmax(-1).tolist() == list(gen_ids)})  # fmt: skip
    strict = sum(r["positions"] - r["rounding_sensitive_positions"] for r in rows)
    total = sum(r["positions"] for r in rows)
    return {"within_bound": not any(r["positions_over_bound"] for r in rows) and 2 * strict >= total,
            "positions_held_to_tol": strict, "positions": total,
            "tokens_identical": all(r["greedy_identical"] for r in rows),
            "max_abs_diff": max(r["max_abs_diff"] for r in rows), "per_sequence": rows}  # fmt: skip
