"""Gate: RWKV-7 served by vLLM in bfloat16 against the official `rwkv` package in bfloat16.

Same random BlinkDL checkpoint (converted), same prompts; the reference is the `rwkv`
package with strategy ``cpu bf16`` (weights and activations bfloat16, WKV state float32,
as its x070 path does) run on exactly the token ids vLLM saw, every prompt position and
generated step compared.

Bound, from bfloat16 rounding (unit roundoff u = 2^-8): both sides compute the same
function from the same bfloat16 weights and differ only in where and in which order they
round intermediate results. How much rounding moves this model's logits is measured on
the independent side: ``E`` = max |rwkv(cpu bf16) - rwkv(cpu fp32)| over every compared
position (the package's own bfloat16 error against its float32 result). A second bfloat16
implementation that rounds comparably is within ``E`` of the float32 result too, so by
the triangle inequality the two bfloat16 runs differ by at most ``2 E``. That is the bound;
a model error (a wrong term, a missing scale) moves logits by O(|logit|), far above it.
RWKV-7 makes no discrete choice (no routing, no top-k), so nothing flips. A greedy token
may differ only at a near-tie: the reference's top-2 gap there within the same ``2 E``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from _rwkv7_cases import CASES, build_case, prompts

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.testing.parity import vllm_logits

pytestmark = [pytest.mark.vllm, pytest.mark.gate]

LENGTHS = (5, 19, 45, 90)
MAX_TOKENS = 8
LLM_KWARGS = {"dtype": "bfloat16", "max_num_batched_tokens": 32, "max_num_seqs": 8, "max_model_len": 256}

# The `rwkv` package picks its x070 path from environment variables at import time: a fresh process.
_RUNNER = r"""
import json, sys, torch
from rwkv.model import RWKV
spec = json.load(open(sys.argv[1]))
model = RWKV(model=spec["pth"][:-4], strategy=spec["strategy"])
out = []
with torch.no_grad():
    for ids in spec["sequences"]:
        logits, _ = model.forward(ids, None, full_output=True)
        out.append(logits.float().reshape(len(ids), -1).clone())
torch.save(out, sys.argv[2])
"""


def rwkv_logits(pth: Path, sequences, strategy: str) -> list[torch.Tensor]:
    with tempfile.TemporaryDirectory(prefix="rwkv-bf16-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.pt"
        spec.write_text(json.dumps({"pth": str(pth), "sequences": sequences, "strategy": strategy}))
        env = {**os.environ, "RWKV_V7_ON": "1", "RWKV_CUDA_ON": "0", "RWKV_JIT_ON": "1"}
        proc = subprocess.run([sys.executable, "-c", _RUNNER, str(spec), str(out)], env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0 and out.exists(), (proc.stdout + proc.stderr)[-3000:]
        return torch.load(out)


@pytest.mark.parametrize("case", list(CASES))
def test_bfloat16_serving_matches_rwkv_package_bfloat16(case, tmp_path, evidence_root):
    rec = EvidenceRecord(model="rwkv7", gate=f"bfloat16_vs_rwkv_bf16_{case}")
    spec = CASES[case]
    pth, hf_dir = build_case(tmp_path, case)
    rec.command(f"ascend_adapters.rwkv7.convert.convert({pth.name}, OUT_DIR)  (tiny random BlinkDL checkpoint)")
    ps = prompts(spec["vocab"], LENGTHS, seed=spec["seed"])
    rec.command(f"vllm.LLM(OUT_DIR, {LLM_KWARGS}, enforce_eager=True) greedy {MAX_TOKENS} tokens, raw logits")
    (seqs,) = vllm_logits(hf_dir, [ps], max_tokens=MAX_TOKENS, llm_kwargs=LLM_KWARGS)
    ids = [s.positions_ids for s in seqs]
    rec.command("rwkv.model.RWKV(SRC, 'cpu bf16') and (SRC, 'cpu fp32'), RWKV_V7_ON=1 RWKV_CUDA_ON=0, same ids")
    ref16, ref32 = rwkv_logits(pth, ids, "cpu bf16"), rwkv_logits(pth, ids, "cpu fp32")

    rounding = max(float((a - b).abs().max()) for a, b in zip(ref16, ref32))  # E
    bound = 2 * rounding
    rows, served_vs_fp32, ties, scale = [], 0.0, [], 0.0
    for seq, r16, r32 in zip(seqs, ref16, ref32):
        got = seq.logits.float()[:, : r16.shape[-1]]
        assert got.shape == r16.shape and torch.isfinite(got).all()
        rows.append((got - r16).abs().amax(-1))
        served_vs_fp32 = max(served_vs_fp32, float((got - r32).abs().max()))
        scale = max(scale, float(r32.abs().max()))
        t = len(seq.prompt_ids)
        for j, tok in enumerate(seq.gen_ids):
            want = int(r16[t - 1 + j].argmax())
            if tok != want:
                gap = float(r16[t - 1 + j, want] - r16[t - 1 + j, tok])
                ties.append({"prompt_len": t, "step": j, "served": tok, "reference": want, "gap": gap})
                break  # later steps continue from the served token, compared position by position
    per_pos = torch.cat(rows)
    worst = float(per_pos.max())
    rec.metric("positions", int(per_pos.numel()))
    rec.metric("max_abs_logit_diff_vs_rwkv_bf16", worst)
    rec.metric("median_position_max_abs_diff_vs_rwkv_bf16", float(per_pos.median()))
    rec.metric("rwkv_bf16_vs_fp32_max_abs_diff", rounding)
    rec.metric("served_bf16_vs_rwkv_fp32_max_abs_diff", served_vs_fp32)
    rec.metric("max_abs_logit_fp32", scale)
    rec.metric("greedy_divergences", ties)
    ok = rec.check(f"every position within 2 E = {bound:.4g} of the rwkv bf16 logits", worst <= bound,
                   {"max_abs_diff": worst, "bound": bound, "positions_over": int((per_pos > bound).sum())})  # fmt: skip
    ok_t = rec.check("greedy tokens identical, or differ only at a near-tie (reference top-2 gap <= 2 E)",
                     all(t["gap"] <= bound for t in ties), ties)  # fmt: skip
    rec.skip("NPU bfloat16 kernels", "no Ascend NPU here; the portable torch path ran in bfloat16")
    rec.write(evidence_root)
    print(f"{case}: served bf16 vs rwkv bf16 max {worst:.4g} (bound 2E = {bound:.4g}, E = {rounding:.4g}); "
          f"served bf16 vs rwkv fp32 {served_vs_fp32:.4g}; |logit| <= {scale:.3g}; divergences {ties}")  # fmt: skip
    assert ok, rec.checks[-2]
    assert ok_t, ties
