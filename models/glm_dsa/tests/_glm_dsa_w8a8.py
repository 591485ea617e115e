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

from _glm_dsa_ref import Reference, random_prompts

from ascend_adapters.testing import w8a8_reference
from ascend_adapters.testing.modelslim import export_w8a8
from ascend_adapters.testing.w8a8_reference import DynamicExperts, StaticLinear, quantize_linear

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
def independent_reference(src: Path, n_layers: int, *, tensor_parallel: int = 1) -> Reference:
    """transformers' model on the float checkpoint, quantized as ``plan`` says by
    ``testing.w8a8_reference`` (ModelSlim's published equations; no exported tensor, no exporter or
    kernel function).

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
            setattr(layer.self_attn, name, StaticLinear(getattr(layer.self_attn, name).weight.detach(), lo, hi))
        if not hasattr(layer.mlp, "experts"):  # a dense MLP layer stays FLOAT (``plan``)
            continue
        for name in ("gate_proj", "up_proj", "down_proj"):
            quantize_linear(layer.mlp.shared_experts, name, tensor_parallel if name == "down_proj" else 1)
        layer.mlp.experts = DynamicExperts(layer.mlp.experts)
    return ref


def compare_within_rounding(sequences, ref: Reference, tol: float) -> dict:
    """``testing.w8a8_reference.compare_within_rounding`` against ``ref``."""
    return w8a8_reference.compare_within_rounding(sequences, ref, tol)
