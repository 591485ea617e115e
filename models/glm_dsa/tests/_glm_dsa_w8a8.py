"""ModelSlim W8A8 export of a tiny GLM-DSA checkpoint and its plain-torch reference.

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

from ascend_adapters.testing.modelslim import ReferenceLinear, export_w8a8, load_export, patch_linears

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


class _RefExperts(torch.nn.Module):
    """transformers' GlmMoeDsaExperts loop, each expert's projections as export ReferenceLinears."""

    def __init__(self, tensors, description, prefix: str, num_experts: int, act):
        super().__init__()
        self.num_experts = num_experts
        self.act = act
        self.lin = [
            {
                p: ReferenceLinear(tensors, description, f"{prefix}.{e}.{p}")
                for p in ("gate_proj", "up_proj", "down_proj")
            }
            for e in range(num_experts)
        ]

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            x = hidden_states[tok]
            lin = self.lin[e]
            y = lin["down_proj"](self.act(lin["gate_proj"](x)) * lin["up_proj"](x))
            out.index_add_(0, tok, y * top_k_weights[tok, pos, None])
        return out


def quantized_reference(src: Path, export: Path) -> Reference:
    """transformers' model with the export's quantized linears and experts applied in plain torch."""
    ref = Reference(src)
    model = ref.model
    patch_linears(model, export, load_float=False)
    tensors, description = load_export(export)
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            layer.mlp.experts = _RefExperts(
                tensors, description, f"model.layers.{i}.mlp.experts", experts.num_experts, experts.act_fn
            )
    return ref
