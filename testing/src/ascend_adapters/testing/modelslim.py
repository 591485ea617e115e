"""Tiny ModelSlim W8A8 exports for tests, and a plain-torch reference of the format.

Two producers:

* ``run_msmodelslim(src, out, mode)``: the real ``msmodelslim`` 26.x CLI on CPU
  (``mode="dynamic"``: its default W8A8 recipe, per-token dynamic activations;
  ``mode="static"``: a ``modelslim_v1`` recipe with per-tensor asymmetric
  activations). Both apply msmodelslim's smoothing (``iter_smooth``), so the
  export's norms differ from the input model's: compare a served export with
  the model *it* describes (``ReferenceLinear`` + the export's own norms).
  The executable is ``$ASCEND_ADAPTERS_MSMODELSLIM``, else ``msmodelslim``
  next to the running Python, else on PATH (``msmodelslim_executable()``).
* ``export_w8a8(src_dir, out_dir, plan)``: our own exporter following the
  documented layout and math (docs/references.md#modelslim-w8a8-layout), for layouts msmodelslim cannot
  produce from tiny models, above all per-expert MoE W8A8_DYNAMIC
  (``...experts.{e}.gate_proj/up_proj/down_proj.weight`` int8 +
  ``weight_scale``/``weight_offset``). ``plan`` maps linear names or fnmatch
  patterns to ``W8A8_DYNAMIC`` / ``W8A8`` / ``FLOAT``.

``ReferenceLinear`` / ``patch_linears`` apply an export's quantized weights in
plain torch (independent of ``ascend_adapters.common.quant``), e.g. inside a
transformers model, to give the reference a served export must match.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

MSMODELSLIM_ENV = "ASCEND_ADAPTERS_MSMODELSLIM"
DESCRIPTION_FILE = "quant_model_description.json"

STATIC_RECIPE = """\
apiversion: modelslim_v1
metadata:
  config_id: ascend-adapters-w8a8-static
  score: 50
  verified_model_types: [ ]
  label:
    w_bit: 8
    a_bit: 8
    is_sparse: False
    kv_cache: False
spec:
  process:
{smooth}    - type: "linear_quant"
      qconfig:
        act:
          scope: "per_tensor"
          dtype: "int8"
          symmetric: False
          method: "minmax"
        weight:
          scope: "per_channel"
          dtype: "int8"
          symmetric: True
          method: "minmax"
      include: [ "*" ]
  runner: "model_wise"
  save:
    - type: "ascendv1_saver"
      part_file_size: 4
"""
SMOOTH_STEP = """    - type: "iter_smooth"
      include:
        - "*"
"""


# -- msmodelslim ----------------------------------------------------------------------------------
def msmodelslim_executable() -> str | None:
    """Path of the msmodelslim CLI, or None when it is not installed."""
    env = os.environ.get(MSMODELSLIM_ENV)
    if env:
        return env if Path(env).exists() or shutil.which(env) else None
    local = Path(sys.executable).parent / "msmodelslim"
    if local.exists():
        return str(local)
    return shutil.which("msmodelslim")


def msmodelslim_missing_reason() -> str | None:
    if msmodelslim_executable() is None:
        return (
            f"msmodelslim not found (pip install msmodelslim==26.1.0 into this venv, or set {MSMODELSLIM_ENV} "
            "to its executable)"
        )
    return None


def run_msmodelslim(
    src: str | os.PathLike,
    out: str | os.PathLike,
    mode: str = "dynamic",
    *,
    smooth: bool = True,
    timeout: float = 900.0,
) -> Path:
    """Quantize the checkpoint ``src`` with the real msmodelslim CLI on CPU into ``out``."""
    exe = msmodelslim_executable()
    if exe is None:
        raise RuntimeError(msmodelslim_missing_reason())
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    cmd = [
        exe,
        "quant",
        "--model_type",
        "default",
        "--model_path",
        str(src),
        "--save_path",
        str(out),
        "--device",
        "cpu",
    ]
    with tempfile.TemporaryDirectory(prefix="msmodelslim-") as tmp:
        if mode == "dynamic":
            if not smooth:
                raise ValueError("mode='dynamic' uses msmodelslim's default recipe, which always smooths")
            cmd += ["--quant_type", "w8a8"]
        elif mode == "static":
            recipe = Path(tmp) / "w8a8_static.yaml"
            recipe.write_text(STATIC_RECIPE.format(smooth=SMOOTH_STEP if smooth else ""))
            cmd += ["--config_path", str(recipe)]
        else:
            raise ValueError(f"mode must be 'dynamic' or 'static', got {mode!r}")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        proc = subprocess.run(cmd, input="y\n", capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
    if proc.returncode != 0 or not (out / DESCRIPTION_FILE).exists():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise RuntimeError(f"msmodelslim failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return out


def make_tiny_llama_exports(
    root: str | os.PathLike, seed: int = 0, modes=("dynamic", "static"), **llama_overrides
) -> dict[str, Path]:
    """A tiny float Llama (``factory.make_tiny_llama``) and its msmodelslim exports under ``root``."""
    from ascend_adapters.testing.factory import make_tiny_llama

    root = Path(root)
    dirs = {"float": make_tiny_llama(root / "float", seed=seed, **llama_overrides)}
    for mode in modes:
        dirs[mode] = run_msmodelslim(dirs["float"], root / f"w8a8_{mode}", mode)
    return dirs


# -- documented-math exporter ---------------------------------------------------------------------
def quantize_weight_per_channel(w) -> tuple:
    """Symmetric per-output-channel int8: ``(w_int8 [N, K], scale [N, 1] float32)``."""
    import torch

    wf = w.float()
    scale = wf.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(wf / scale).clamp(-127, 127).to(torch.int8)
    return q, scale.to(torch.float32)


def static_activation_params(lo: float, hi: float) -> tuple[float, float]:
    """Per-tensor asymmetric int8 ``(input_scale, input_offset)`` covering [lo, hi] (0 included)."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    scale = (hi - lo) / 255.0 if hi > lo else 1.0
    offset = float(round(-128.0 - lo / scale))
    return scale, offset


def _read_tensors(src_dir: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(src_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src_dir}: no *.safetensors files")
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _match(name: str, plan: Mapping[str, str]) -> str | None:
    prefix = name[: -len(".weight")]
    for key, kind in plan.items():
        k = key[: -len(".weight")] if key.endswith(".weight") else key
        if k == prefix or fnmatch.fnmatchcase(prefix, k):
            return kind
    return None


def export_w8a8(
    src_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    plan: Mapping[str, str],
    *,
    input_ranges: Mapping[str, tuple[float, float]] | None = None,
    transform: Callable[[str, object], Iterable[tuple[str, object]]] | None = None,
    style: str = "new",
    max_shard_bytes: int | None = None,
    deq_scale_dtype: str = "int64",
    model_quant_type: str | None = None,
) -> Path:
    """Write a ModelSlim-layout export of the float checkpoint ``src_dir`` into ``out_dir``.

    ``plan``: linear name (``prefix`` or ``prefix.weight``) or fnmatch pattern -> ``W8A8_DYNAMIC`` |
    ``W8A8`` | ``FLOAT``; the first matching entry wins, unmatched tensors stay FLOAT.
    ``input_ranges``: ``prefix -> (min, max)`` of the layer's input, required for static ``W8A8``
    (e.g. recorded with forward hooks on calibration text).
    ``transform(name, tensor)``: yields the (name, tensor) pairs to export for one source tensor
    (e.g. to split fused experts into per-expert ``gate_proj/up_proj/down_proj``).
    ``style``: ``"new"`` (``quant_model_weights-0000N-of-0000M.safetensors`` + index, msmodelslim 26.x)
    or ``"old"`` (``quant_model_weight_w8a8.safetensors``, sharded with an index when needed).
    ``deq_scale_dtype``: ``"int64"`` (float32 bit pattern, float32/float16 models) or ``"float32"``.
    Copies config.json, tokenizer and other non-weight files unchanged.
    """
    import torch

    from ascend_adapters.testing.factory import write_safetensors_shards

    src_dir, out_dir = Path(src_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in src_dir.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy2(f, out_dir / f.name)
    tensors = _read_tensors(src_dir)
    if transform is not None:
        tensors = {k: v for name, t in tensors.items() for k, v in transform(name, t)}
    out, desc, kinds = {}, {}, set()
    for name, t in tensors.items():
        kind = _match(name, plan) if name.endswith(".weight") and t.dim() == 2 else None
        if kind is None or kind == "FLOAT":
            out[name] = t
            desc[name] = "FLOAT"
            continue
        prefix = name[: -len(".weight")]
        q, wscale = quantize_weight_per_channel(t)
        kinds.add(kind)
        if kind == "W8A8_DYNAMIC":
            comp = {"weight": q, "weight_scale": wscale, "weight_offset": torch.zeros_like(wscale)}
        elif kind == "W8A8":
            if not input_ranges or prefix not in input_ranges:
                raise ValueError(f"{prefix}: static W8A8 needs its input range in input_ranges")
            iscale, ioff = static_activation_params(*input_ranges[prefix])
            deq = (torch.tensor(iscale, dtype=torch.float32) * wscale.reshape(-1)).to(torch.float32)
            bias = tensors.get(prefix + ".bias")
            b = bias.float() if bias is not None else torch.zeros(q.shape[0])
            qbias = torch.round(b / deq - q.to(torch.float64).sum(1).float() * ioff).to(torch.int32)
            if deq_scale_dtype == "int64":
                deq_out = deq.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
            elif deq_scale_dtype == "float32":
                deq_out = deq
            else:
                raise ValueError(f"deq_scale_dtype must be 'int64' or 'float32', got {deq_scale_dtype!r}")
            comp = {
                "weight": q,
                "input_scale": torch.tensor([iscale], dtype=torch.float32),
                "input_offset": torch.tensor([ioff], dtype=torch.float32),
                "deq_scale": deq_out,
                "quant_bias": qbias,
            }
        else:
            raise ValueError(f"{prefix}: unsupported plan type {kind!r} (W8A8_DYNAMIC, W8A8, FLOAT)")
        for suffix, v in comp.items():
            out[f"{prefix}.{suffix}"] = v
            desc[f"{prefix}.{suffix}"] = kind
    for name in list(out):  # a static layer's float bias is folded into quant_bias; msmodelslim keeps it, typed
        if name.endswith(".bias") and desc.get(name[: -len(".bias")] + ".weight") == "W8A8":
            desc[name] = "W8A8"
    if model_quant_type is None:
        model_quant_type = (
            "W8A8_DYNAMIC"
            if kinds == {"W8A8_DYNAMIC"}
            else ("W8A8" if kinds == {"W8A8"} else "W8A8_MIX" if kinds else "FLOAT")
        )
    description = {
        **desc,
        "version": "1.0.0",
        "model_quant_type": model_quant_type,
        "metadata": {},
        "group_size": 0,
        "optional": {},
    }
    if style == "new":
        names = write_safetensors_shards(out_dir, out, max_shard_bytes=max_shard_bytes, stem="quant_model_weights")
        if len(names) == 1:  # msmodelslim 26.x always writes the -0000N-of-0000M name and an index
            single = out_dir / names[0]
            final = out_dir / "quant_model_weights-00001-of-00001.safetensors"
            single.rename(final)
            index = {
                "metadata": {"total_size": sum(v.numel() * v.element_size() for v in out.values())},
                "weight_map": {k: final.name for k in out},
            }
            (out_dir / "quant_model_weights.safetensors.index.json").write_text(json.dumps(index, indent=2))
    elif style == "old":
        write_safetensors_shards(out_dir, out, max_shard_bytes=max_shard_bytes, stem="quant_model_weight_w8a8")
    else:
        raise ValueError(f"style must be 'new' or 'old', got {style!r}")
    (out_dir / DESCRIPTION_FILE).write_text(json.dumps(description, indent=2))
    return out_dir


def split_fused_experts(name: str, tensor) -> Iterable[tuple[str, object]]:
    """``transform`` for ``export_w8a8``: transformers' fused expert tensors -> ModelSlim per-expert names.

    ``<p>.experts.gate_up_proj [E, 2I, H]`` -> ``<p>.experts.{e}.gate_proj.weight`` / ``up_proj.weight``;
    ``<p>.experts.down_proj [E, H, I]`` -> ``<p>.experts.{e}.down_proj.weight``; other tensors unchanged.
    """
    if name.endswith(".experts.gate_up_proj") and tensor.dim() == 3:
        base = name[: -len("gate_up_proj")]
        for e in range(tensor.shape[0]):
            gate, up = tensor[e].chunk(2, dim=0)
            yield f"{base}{e}.gate_proj.weight", gate.contiguous()
            yield f"{base}{e}.up_proj.weight", up.contiguous()
    elif name.endswith(".experts.down_proj") and tensor.dim() == 3:
        base = name[: -len("down_proj")]
        for e in range(tensor.shape[0]):
            yield f"{base}{e}.down_proj.weight", tensor[e].contiguous()
    else:
        yield name, tensor


def record_input_ranges(model, inputs: Iterable, prefixes: Iterable[str] | None = None) -> dict:
    """``prefix -> (min, max)`` of every ``nn.Linear`` input while ``model(x)`` runs on each of ``inputs``
    (for ``export_w8a8(..., input_ranges=...)`` with static W8A8). ``prefixes``: fnmatch filters."""
    import torch

    pats = list(prefixes) if prefixes is not None else ["*"]
    ranges: dict[str, list[float]] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and any(fnmatch.fnmatchcase(name, p) for p in pats):

            def hook(_m, args, _out, name=name):
                x = args[0].detach()
                lo, hi = float(x.min()), float(x.max())
                r = ranges.setdefault(name, [lo, hi])
                r[0], r[1] = min(r[0], lo), max(r[1], hi)

            hooks.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad():
            for x in inputs:
                model(x)
    finally:
        for h in hooks:
            h.remove()
    return {k: (v[0], v[1]) for k, v in ranges.items()}


# -- plain-torch reference ------------------------------------------------------------------------
def load_export(export_dir: str | os.PathLike) -> tuple[dict, dict]:
    """``(tensors, description)`` of an export."""
    export_dir = Path(export_dir)
    return _read_tensors(export_dir), json.loads((export_dir / DESCRIPTION_FILE).read_text())


def _deq_scale_f32(deq):
    import torch

    if deq.is_floating_point():
        return deq.float()
    bits = deq.to(torch.int64) & 0xFFFFFFFF
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(torch.int32).view(torch.float32)


def effective_float_weight(tensors: Mapping, description: Mapping, prefix: str):
    """The float weight an export's layer stands for (dequantized int8 weight, or the float weight)."""
    w = tensors[prefix + ".weight"]
    kind = description.get(prefix + ".weight", "FLOAT")
    if kind == "W8A8_DYNAMIC":
        return w.float() * tensors[prefix + ".weight_scale"].float().reshape(-1, 1)
    if kind == "W8A8":
        wscale = _deq_scale_f32(tensors[prefix + ".deq_scale"]) / tensors[prefix + ".input_scale"].float()
        return w.float() * wscale.reshape(-1, 1)
    return w.float()


class ReferenceLinear:
    """One exported linear in plain torch, written from the documented equations (docs/references.md#modelslim-w8a8-math).

    Independent of ascend_adapters.common.quant: activation quantization in float32, the integer
    product as an exact float64 matmul of the int8 values.
    """

    def __init__(self, tensors: Mapping, description: Mapping, prefix: str):
        import torch

        self.prefix = prefix
        self.kind = description.get(prefix + ".weight", "FLOAT")
        g = lambda s: tensors.get(f"{prefix}.{s}")  # noqa: E731
        self.weight = g("weight")
        self.bias = g("bias")
        if self.kind == "W8A8_DYNAMIC":
            self.wscale = g("weight_scale").float().reshape(-1)
        elif self.kind == "W8A8":
            self.iscale = g("input_scale").float().reshape(-1)[0]
            self.ioff = g("input_offset").float().reshape(-1)[0]
            self.deq = _deq_scale_f32(g("deq_scale")).reshape(-1)
            self.qbias = g("quant_bias").to(torch.int64).reshape(-1)
        self.w64 = self.weight.to(torch.float64)

    def __call__(self, x):
        import torch

        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        if self.kind == "FLOAT":
            y = x2 @ self.weight.float().t()
            if self.bias is not None:
                y = y + self.bias.float()
        elif self.kind == "W8A8_DYNAMIC":
            s = x2.abs().amax(-1, keepdim=True) / 127.0
            xq = torch.where(s > 0, torch.round(x2 / torch.where(s > 0, s, 1.0)), 0.0).clamp(-127, 127)
            acc = (xq.to(torch.float64) @ self.w64.t()).round()
            y = acc.float() * (s * self.wscale)
            if self.bias is not None:
                y = y + self.bias.float()
        elif self.kind == "W8A8":
            xq = torch.round(x2 / self.iscale + self.ioff).clamp(-128, 127)
            acc = (xq.to(torch.float64) @ self.w64.t()).round() + self.qbias.to(torch.float64)
            y = acc.float() * self.deq
        else:
            raise ValueError(f"{self.prefix}: reference does not know type {self.kind}")
        return y.to(x.dtype).reshape(*shape[:-1], -1)


def patch_linears(model, export_dir: str | os.PathLike, *, load_float: bool = True):
    """Load an export into a transformers model: FLOAT tensors as they are, and every quantized
    ``nn.Linear`` of the description replaced by its ``ReferenceLinear``. Returns the model."""
    import torch

    tensors, description = load_export(export_dir)
    if load_float:
        state = {k: v for k, v in tensors.items() if description.get(k, "FLOAT") == "FLOAT"}
        _, unexpected = model.load_state_dict(state, strict=False)
        if unexpected:
            raise ValueError(f"export tensors the model does not have: {unexpected[:5]}")
    wrap = _module_class()
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear) or description.get(name + ".weight", "FLOAT") == "FLOAT":
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, wrap(ReferenceLinear(tensors, description, name)))
    return model


def _module_class():
    import torch

    class ReferenceLinearModule(torch.nn.Module):
        def __init__(self, ref: ReferenceLinear):
            super().__init__()
            self.ref = ref

        def forward(self, x):
            return self.ref(x)

    return ReferenceLinearModule


def dynamic_linear_storage(model) -> dict:
    """How a served model keeps its W8A8_DYNAMIC linear weights (a probe for ``parity.vllm_logits``).

    ``layers``: linears with the ModelSlim dynamic method; ``engine_prepacked``: those served by the
    engine's prepacked GEMM; ``plain_weight_kept``: those still holding a plain int8 ``weight``;
    ``cpu_layouts``: the worker's own decisions (``portable.cpu_layout``, with why) for its linears' dtypes.
    """
    from ascend_adapters.common.quant.kernels import portable
    from ascend_adapters.common.quant.linear import ModelSlimW8A8DynamicLinearMethod

    out = {"layers": 0, "engine_prepacked": 0, "plain_weight_kept": 0, "cpu_layouts": {}}
    for module in model.modules():
        if not isinstance(getattr(module, "quant_method", None), ModelSlimW8A8DynamicLinearMethod):
            continue
        dtype = getattr(module, "modelslim_out_dtype", None)
        if dtype is not None and str(dtype) not in out["cpu_layouts"]:
            out["cpu_layouts"][str(dtype)] = {k: str(v) for k, v in portable.cpu_layout(dtype).items()}
        out["layers"] += 1
        out["engine_prepacked"] += getattr(module, "modelslim_engine_linear", None) is not None
        out["plain_weight_kept"] += getattr(module, "weight", None) is not None
    return out


# ModelSlim W8A8_DYNAMIC plan for the tiny DeepSeek-V4 checkpoint (native export names; fnmatch on the linear
# prefix; ascend_adapters.testing.modelslim.export_w8a8): attention
# projections, shared and routed experts. Router, compressor/indexer projections (kept in float by
# transformers' own DeepSeek-V4 loading as well), the grouped wo_a, embeddings and head stay FLOAT.
DEEPSEEK_V4_W8A8_PLAN = {
    "*.attn.wq_a": "W8A8_DYNAMIC",
    "*.attn.wkv": "W8A8_DYNAMIC",
    "*.attn.wq_b": "W8A8_DYNAMIC",
    "*.attn.wo_b": "W8A8_DYNAMIC",
    "*.ffn.shared_experts.*": "W8A8_DYNAMIC",
    "*.ffn.experts.*": "W8A8_DYNAMIC",
}
