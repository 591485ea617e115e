"""DeepSeek's own release layout (``quant_method: fp8``) served as published.

The tiny release (``tiny.write_release``) has the published names, dtypes and config fields: FP8
e4m3 block-scaled attention and shared-expert linears with F8_E8M0 ``.scale`` per 128x128 block,
FP4 e2m1 routed experts (two per int8 byte, low nibble first, F8_E8M0 scale per 32 inputs), BF16
compressor / indexer projections, F32 mHC / sinks, ``mtp.0.*`` tensors. vLLM serves it in float32
(the model dequantizes at load) with its MTP layer drafting one token per step, as DeepSeek-V4 is
deployed; the check is on the target's logits (drafts change no token), and vLLM's counters show drafts. Reference: transformers' DeepseekV4ForCausalLM with the weights
decoded by ``_decode_*`` below, from the bit layout (no torch float8 conversion, no code of the
adapter), so the bound is float32 noise: 1e-3 as in the float parity gate.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from _dsv4_cases import hf_model, prompts, reference_fn

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.deepseek_v4.tiny import make_tiny, write_release
from ascend_adapters.testing.engine_worker import engine_run

TOL = 1e-3
# served as DeepSeek-V4 is deployed: with its MTP layer drafting one token (vllm-ascend's setting)
LLM_KWARGS = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 256,
    "kv_cache_memory_bytes": 64 << 20,
    "max_num_seqs": 8,
    "speculative_config": {"method": "mtp", "num_speculative_tokens": 1},
}
HCA128 = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def _decode_e8m0(s: torch.Tensor) -> torch.Tensor:
    return torch.exp2(s.view(torch.uint8).double() - 127.0)


def _decode_e4m3(w: torch.Tensor) -> torch.Tensor:
    b = w.view(torch.uint8).long()
    sign = torch.where((b >> 7) == 1, -1.0, 1.0).double()
    exp, man = (b >> 3) & 0xF, (b & 0x7).double()
    normal = (1.0 + man / 8.0) * torch.exp2(exp.double() - 7.0)
    sub = (man / 8.0) * 2.0**-6
    return sign * torch.where(exp == 0, sub, normal)


def _decode_e2m1(code: torch.Tensor) -> torch.Tensor:
    sign = torch.where((code >> 3) == 1, -1.0, 1.0).double()
    exp, man = (code >> 1) & 0x3, (code & 0x1).double()
    normal = (1.0 + man / 2.0) * torch.exp2(exp.double() - 1.0)
    return sign * torch.where(exp == 0, man * 0.5, normal)


def _reference_weight(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    scale = _decode_e8m0(s)
    if w.dtype == torch.float8_e4m3fn:
        vals = _decode_e4m3(w)
        rows = torch.arange(vals.shape[0]) // 128
        cols = torch.arange(vals.shape[1]) // 128
        return (vals * scale[rows][:, cols]).float()
    b = w.view(torch.uint8).long()
    lo, hi = _decode_e2m1(b & 0xF), _decode_e2m1(b >> 4)
    vals = torch.empty(b.shape[0], 2 * b.shape[1], dtype=torch.float64)
    vals[:, 0::2], vals[:, 1::2] = lo, hi
    return (vals * scale[:, torch.arange(vals.shape[1]) // 32]).float()


def _reference_dir(release, hf_dir, out):
    """The transformers-saved tiny with every tensor replaced by the release's, decoded to float32."""
    from safetensors.torch import load_file, save_file

    rel = load_file(str(release / "model.safetensors"))
    saved = load_file(str(hf_dir / "model.safetensors"))
    from ascend_adapters.deepseek_v4.tiny import native_name  # the name table only, no dequantization

    tensors, n_fp8, n_fp4 = {}, 0, 0
    for name, t in saved.items():
        n = native_name(name)
        base = n[: -len(".weight")]
        if f"{base}.scale" in rel:
            w = rel[n]
            n_fp8 += w.dtype == torch.float8_e4m3fn
            n_fp4 += w.dtype == torch.int8
            tensors[name] = _reference_weight(w, rel[f"{base}.scale"])
        else:
            tensors[name] = rel[n].to(t.dtype) if rel[n].is_floating_point() else rel[n]
        assert tensors[name].shape == t.shape, name
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in hf_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    return out, n_fp8, n_fp4


@pytest.mark.vllm
@pytest.mark.gate
def test_official_release_layout_served_as_published(tmp_path, evidence_root):
    hf_dir = make_tiny(tmp_path / "hf", seed=6, mtp=True, compress_rates=HCA128)
    release = write_release(hf_dir, tmp_path / "release")
    ref_dir, n_fp8, n_fp4 = _reference_dir(release, hf_dir, tmp_path / "reference")
    cfg = json.loads((release / "config.json").read_text())
    rec = EvidenceRecord(model="deepseek_v4", gate="official_release_fp8_fp4")
    rec.command(f"write_release(tiny) -> vllm.LLM({release}, {LLM_KWARGS}) greedy, raw logits; reference transformers")
    rec.metric("fp8_block_weights", int(n_fp8))
    rec.metric("fp4_expert_weights", int(n_fp4))
    rec.metric("quantization_config", cfg["quantization_config"])
    ps = prompts((9, 150), seed=16)
    (batch,) = engine_run(release, [ps], 6, LLM_KWARGS)
    ref, unquantized = reference_fn(hf_model(ref_dir)), reference_fn(hf_model(hf_dir))
    worst, worst_unquantized, identical = 0.0, 0.0, True
    for row in batch["rows"]:
        t = len(row["prompt_ids"])
        ids = row["prompt_ids"] + row["gen_ids"][:-1]
        want, other = ref(ids)[t - 1 :], unquantized(ids)[t - 1 :]
        worst = max(worst, float((row["logits"] - want).abs().max()))
        worst_unquantized = max(worst_unquantized, float((row["logits"] - other).abs().max()))
        identical &= row["gen_ids"] == want.argmax(-1).tolist()
    c = batch["counters"]
    rec.metric("max_abs_diff_vs_decoded_reference", worst)
    rec.metric("max_abs_diff_vs_unquantized_model", worst_unquantized)
    rec.metric("spec_decode_counters", c)
    rec.check("logits within 1e-3 of the decoded reference", worst < TOL, f"{worst:.3e}")
    rec.check("greedy tokens identical to the decoded reference", identical)
    rec.check("weights really are FP8/FP4 (differ from the unquantized model)", worst_unquantized > TOL)
    rec.check("the release's MTP layer drafted (vLLM's counters)", c.get("vllm:spec_decode_num_drafts", 0) > 0, c)
    rec.write(evidence_root)
    assert n_fp8 and n_fp4
    assert rec.passed, rec.checks
