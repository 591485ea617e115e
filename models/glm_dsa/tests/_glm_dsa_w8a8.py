"""ModelSlim W8A8 export of a tiny GLM-DSA checkpoint, and a reference quantized independently of it.

msmodelslim cannot produce this layout from a tiny GLM-DSA (its GLM-5 adapter builds the full-size
model; its default adapter leaves routed experts float under transformers' fused names, docs/references.md#msmodelslim-tiny-moe),
so the export is written by common's documented-math exporter (``testing.modelslim.export_w8a8``):
static W8A8 attention linears except ``kv_b_proj`` (per-tensor activation ranges calibrated with
forward hooks on the transformers model), W8A8_DYNAMIC routed (per expert) and shared experts, FLOAT
elsewhere. ``kv_b_proj`` stays FLOAT as in the released GLM-5.1 W8A8 export (docs/references.md#glm51-w8a8-layout): the adapter
attends in the latent space and folds that weight into the query and the output.
"""

from __future__ import annotations

from pathlib import Path

import torch
from _glm_dsa_ref import Reference, random_prompts

from ascend_adapters.testing.modelslim import export_w8a8

ATTN_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")


def plan(n_layers: int, attn_linears=ATTN_LINEARS) -> dict[str, str]:
    """Main layers only: the MTP layer after them stays FLOAT (as released exports often leave it)."""
    out = {}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        out.update({f"{p}self_attn.{n}": "W8A8" for n in attn_linears})
        out.update({f"{p}mlp.experts.*.{n}": "W8A8_DYNAMIC" for n in ("gate_proj", "up_proj", "down_proj")})
        out[f"{p}mlp.shared_experts.*"] = "W8A8_DYNAMIC"
    return out


def calibrate(src: Path, n_layers: int, attn_linears=ATTN_LINEARS) -> dict[str, tuple[float, float]]:
    """Input (min, max) of every attention linear over a few random prompts."""
    ref = Reference(src)
    ranges: dict[str, list[float]] = {}
    hooks = []
    for i in range(n_layers):
        for n in attn_linears:
            name = f"model.layers.{i}.self_attn.{n}"
            mod = ref.model.get_submodule(name)

            def hook(m, args, _name=name):
                x = args[0]
                lo, hi = ranges.get(_name, [float("inf"), float("-inf")])
                ranges[_name] = [min(lo, float(x.min())), max(hi, float(x.max()))]

            hooks.append(mod.register_forward_pre_hook(hook))
    for ids in random_prompts([40, 40, 40], seed=11):
        ref(ids)
    for h in hooks:
        h.remove()
    return {k: (v[0], v[1]) for k, v in ranges.items()}


def make_export(src: Path, out: Path, n_layers: int, attn_linears=ATTN_LINEARS) -> Path:
    return export_w8a8(src, out, plan(n_layers, attn_linears), input_ranges=calibrate(src, n_layers, attn_linears))


# -- independent reference ---------------------------------------------------------------------
# Quantized here from the float checkpoint with ModelSlim's published equations
# (docs/references.md#modelslim-w8a8-math), sharing no function with the exporter (testing.modelslim) or the
# kernels (common.quant): y = (x_q . W_q^T) * (s_x * s_w), the integer product exact (float64 holds every
# int8 x int8 sum here), so only the float32 scaling and everything outside the linears round.


def _symmetric_int8(t: torch.Tensor, slices: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)``, symmetric int8 per row (a weight's output channel, an activation's token) over each of
    ``slices`` equal slices of the last dim: ``q [..., slices, K / slices]`` integers, ``s [..., slices, 1]``."""
    ts = t.float().unflatten(-1, (slices, -1))
    s = ts.abs().amax(-1, keepdim=True) / 127.0
    s = torch.where(s > 0, s, 1.0)
    return torch.round(ts / s).clamp(-127, 127), s


def _dynamic_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, slices: int = 1) -> torch.Tensor:
    """W8A8_DYNAMIC: per-token activations; ``slices`` ranks of a row-parallel linear each quantize and
    multiply their own input slice, and their partial outputs are summed (the all-reduce)."""
    xq, xs = _symmetric_int8(x, slices)  # [T, R, K/R], [T, R, 1]
    wr = wq.double().unflatten(-1, (slices, -1))  # [N, R, K/R]
    acc = torch.einsum("trk,nrk->trn", xq.double(), wr).float()
    return (acc * (xs * ws.reshape(1, 1, -1))).sum(1)


class _DynamicLinear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, slices: int = 1):
        super().__init__()
        q, s = _symmetric_int8(weight)
        self.wq, self.ws, self.slices = q[:, 0], s[:, 0, 0], slices

    def forward(self, x):
        return _dynamic_linear(x.reshape(-1, x.shape[-1]), self.wq, self.ws, self.slices).reshape(*x.shape[:-1], -1)


class _StaticLinear(torch.nn.Module):
    """W8A8: one asymmetric int8 grid for the input covering the calibrated [lo, hi] (0 included)."""

    def __init__(self, weight: torch.Tensor, lo: float, hi: float):
        super().__init__()
        q, s = _symmetric_int8(weight)
        self.wq, self.ws = q[:, 0].double(), s[:, 0, 0]
        lo, hi = min(lo, 0.0), max(hi, 0.0)
        self.scale = torch.tensor((hi - lo) / 255.0, dtype=torch.float32)
        self.offset = float(round(-128.0 - lo / float(self.scale)))

    def forward(self, x):
        xq = torch.round(x.float() / self.scale + self.offset).clamp(-128, 127) - self.offset
        return ((xq.double() @ self.wq.t()).float() * (self.scale * self.ws)).to(x.dtype)


class _IndependentExperts(torch.nn.Module):
    """transformers' routed-expert loop over its fused expert tensors, each projection W8A8_DYNAMIC."""

    def __init__(self, experts):
        super().__init__()
        self.num_experts = experts.num_experts
        self.act = experts.act_fn
        self.gate_up = [_DynamicLinear(w) for w in experts.gate_up_proj.detach()]  # [2I, H] each
        self.down = [_DynamicLinear(w) for w in experts.down_proj.detach()]  # [H, I] each

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            gate, up = self.gate_up[e](hidden_states[tok]).chunk(2, dim=-1)
            out.index_add_(0, tok, self.down[e](self.act(gate) * up) * top_k_weights[tok, pos, None])
        return out


def independent_reference(src: Path, n_layers: int, *, tensor_parallel: int = 1) -> Reference:
    """transformers' model on the float checkpoint, quantized as ``plan`` says from the published math.

    The static linears' input ranges come from the same calibration run the export was made with
    (``calibrate``: the data, not the math, both sides share). ``tensor_parallel``: the ranks a
    row-parallel W8A8_DYNAMIC linear (the shared experts' down_proj) splits its input over, each
    quantizing its own slice; routed experts stay whole on one rank under expert parallelism.
    """
    input_ranges = calibrate(src, n_layers)
    ref = Reference(src)
    for i in range(n_layers):
        layer = ref.model.model.layers[i]
        for name in ATTN_LINEARS:
            lo, hi = input_ranges[f"model.layers.{i}.self_attn.{name}"]
            setattr(layer.self_attn, name, _StaticLinear(getattr(layer.self_attn, name).weight.detach(), lo, hi))
        if not hasattr(layer.mlp, "experts"):  # a dense MLP layer stays FLOAT (``plan``)
            continue
        shared = layer.mlp.shared_experts
        for name in ("gate_proj", "up_proj", "down_proj"):
            slices = tensor_parallel if name == "down_proj" else 1
            setattr(shared, name, _DynamicLinear(getattr(shared, name).weight.detach(), slices))
        layer.mlp.experts = _IndependentExperts(layer.mlp.experts)
    return ref


# -- bound -----------------------------------------------------------------------------------------
# Float32 rounding alone leaves the served logits within TOL of the reference (the W8A8 gate's derivation,
# test_glm_dsa_w8a8.TOL), but quantization is discontinuous: where an activation sits within rounding of an
# int8 rounding boundary, two correct implementations may round it to neighbouring steps, and that step
# reaches the logits (of its position and, through attention, of later ones) at ~1e-2. Which positions can
# do that is measured on the reference: every decoder layer's output multiplied by (1 + 2^-23 n), n
# standard normal, i.e. one float32 rounding of the residual sum, in DRAWS independent draws. S(t) = the
# largest logit change at position t. Served and reference are two such perturbations of the same math,
# so |served - reference| <= TOL + 2 S(t) (each within S(t) of the exact-order result); positions the
# noise never moves keep TOL.
ROUNDING_REL = 2.0**-23
DRAWS = 4


def rounding_sensitivity(ref: Reference, ids: list[int]) -> torch.Tensor:
    """S(t) per position of ``ids``: max |logits(perturbed) - logits| over DRAWS draws."""
    base = ref(ids)
    gen = torch.Generator().manual_seed(0)

    def perturb(module, args, out):
        h = out[0] if isinstance(out, tuple) else out
        h = h * (1 + ROUNDING_REL * torch.randn(h.shape, generator=gen))
        return (h, *out[1:]) if isinstance(out, tuple) else h

    worst = torch.zeros(len(ids))
    for _ in range(DRAWS):
        hooks = [layer.register_forward_hook(perturb) for layer in ref.model.model.layers]
        try:
            worst = torch.maximum(worst, (ref(ids) - base).abs().amax(-1))
        finally:
            for h in hooks:
                h.remove()
    return worst


def compare_within_rounding(sequences, ref: Reference, tol: float) -> dict:
    """Served ``(prompt_ids, gen_ids, logits)`` against ``ref`` position by position within tol + 2 S(t).

    ``logits`` covers the last ``len(logits)`` positions of ``prompt_ids + gen_ids[:-1]`` (every position
    for ``parity.vllm_logits``, the generated steps for ``engine_worker.engine_run``)."""
    rows = []
    for prompt_ids, gen_ids, logits in sequences:
        ids = prompt_ids + gen_ids[:-1]
        first = len(ids) - logits.shape[0]
        got = logits.float()
        want = ref(ids)[first:, : got.shape[-1]]
        diff = (got - want).abs().amax(-1)
        sens = rounding_sensitivity(ref, ids)[first:]
        calm = sens <= tol
        rows.append({"prompt_len": len(prompt_ids), "positions": len(diff), "max_abs_diff": float(diff.max()),
                     "rounding_sensitive_positions": int((~calm).sum()), "max_sensitivity": float(sens.max()),
                     "max_abs_diff_where_insensitive": float(diff[calm].max()) if calm.any() else None,
                     "positions_over_bound": (first + (diff > tol + 2 * sens).nonzero().flatten()).tolist(),
                     "greedy_identical": want[-len(gen_ids):].argmax(-1).tolist() == gen_ids})  # fmt: skip
    strict = sum(r["positions"] - r["rounding_sensitive_positions"] for r in rows)
    total = sum(r["positions"] for r in rows)
    # the bound must still compare: at least half of all positions held to tol itself
    return {"within_bound": not any(r["positions_over_bound"] for r in rows) and 2 * strict >= total,
            "positions_held_to_tol": strict, "positions": total,
            "tokens_identical": all(r["greedy_identical"] for r in rows),
            "max_abs_diff": max(r["max_abs_diff"] for r in rows), "per_sequence": rows}  # fmt: skip
