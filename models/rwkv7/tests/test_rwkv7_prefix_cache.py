"""Gate: prefix caching of RWKV-7's recurrent state (vLLM's "align" mode), CPU, float32.

One engine with ``--enable-prefix-caching`` and ``block_size=16`` serves three requests one
after another:

* A: a 48-token prefix P (3 whole blocks) + 13 tokens. Its prefill is split at the last
  block boundary, so the state after P stays in block 3's slot.
* B: P + 9 other tokens. It shares 3 whole blocks with A and must resume from the cached
  state: vLLM's own counters (``vllm:prefix_cache_hits``, the request's ``num_cached_tokens``)
  register 48 cached tokens.
* C: P + A's next 5 tokens + 10 others: it diverges inside block 4, so only the 3 whole
  blocks can be reused and the rest is recomputed.

Each request's generated-step logits are compared with the official `rwkv` package and with
the same requests on an engine without prefix caching, at the parity gate's bound.
"""

from __future__ import annotations

import pytest
from _rwkv7_cases import CASES, build_case, prompts
from _rwkv7_ref import rwkv_package_logits

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.testing.engine_worker import engine_run

CASE = "h64x2_l3"
BLOCK = 16
SHARED = 3 * BLOCK
MAX_TOKENS = 8
BASE = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 256,
    "kv_cache_memory_bytes": 64 << 20,
    "max_num_seqs": 8,
    "block_size": BLOCK,
    "max_num_batched_tokens": 32,
}
# the parity gate's bound (test_rwkv7_parity.py): resuming from a copied state is exact, so the
# cached run differs from the uncached one and from the reference only by float32 rounding
TOL = 1e-4


def _run(model_dir, runs, prefix_caching: bool):
    return engine_run(model_dir, runs, MAX_TOKENS, {**BASE, "enable_prefix_caching": prefix_caching})


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    spec = CASES[CASE]
    pth, hf_dir = build_case(tmp_path_factory.mktemp("rwkv7-prefix"), CASE)
    p, tail_a, tail_b, tail_c = prompts(spec["vocab"], (SHARED, 13, 9, 10), seed=11)
    a, b, c = p + tail_a, p + tail_b, p + tail_a[:5] + tail_c
    runs = [[a], [b], [c]]
    cached = _run(hf_dir, runs, prefix_caching=True)
    uncached = _run(hf_dir, runs, prefix_caching=False)
    seqs = [r["rows"][0] for r in cached]
    ref = rwkv_package_logits(pth, [s["prompt_ids"] + s["gen_ids"][:-1] for s in seqs])
    ref_gen = [r[len(s["prompt_ids"]) - 1 :] for s, r in zip(seqs, ref)]
    return {"cached": cached, "uncached": uncached, "ref": ref_gen, "spec": spec}


def _diff(x, y):
    v = min(x.shape[-1], y.shape[-1])
    return float((x[:, :v] - y[:, :v]).abs().max())


@pytest.mark.vllm
def test_shared_whole_blocks_register_prefix_cache_hits(result):
    a, b, c = result["cached"]
    assert a["rows"][0]["num_cached_tokens"] == 0
    assert b["rows"][0]["num_cached_tokens"] == SHARED and b["hits"] >= SHARED, (b["hits"], b["queries"])
    # diverges inside the 4th block: the 3 whole shared blocks are reused, not the partial one
    assert c["rows"][0]["num_cached_tokens"] == SHARED and c["hits"] >= SHARED
    assert all(r["rows"][0]["num_cached_tokens"] == 0 and r["hits"] == 0 for r in result["uncached"])


@pytest.mark.vllm
def test_cached_logits_equal_uncached_and_rwkv_package(result):
    for i, (got, plain, ref) in enumerate(zip(result["cached"], result["uncached"], result["ref"])):
        row, plain_row = got["rows"][0], plain["rows"][0]
        assert row["gen_ids"] == plain_row["gen_ids"], f"request {'ABC'[i]}"
        assert _diff(row["logits"], plain_row["logits"]) < TOL, f"request {'ABC'[i]}"
        assert _diff(row["logits"], ref) < TOL, f"request {'ABC'[i]}"
        assert row["gen_ids"] == ref.argmax(-1).tolist(), f"request {'ABC'[i]}"


@pytest.mark.vllm
@pytest.mark.gate
def test_prefix_cache_gate_evidence(result, evidence_root):
    rec = EvidenceRecord(model="rwkv7", gate="prefix_cache")
    rec.command("python -m ascend_adapters.rwkv7.convert SRC.pth OUT_DIR  (tiny random BlinkDL checkpoint)")
    rec.command(
        f"vllm.LLM(OUT_DIR, dtype=float32, enforce_eager=True, enable_prefix_caching=True, block_size={BLOCK}, "
        "max_num_batched_tokens=32, logprobs_mode=raw_logits, disable_log_stats=False): requests A, B, C in turn; "
        "the same on an engine without prefix caching"
    )
    rec.command("rwkv.model.RWKV(SRC, 'cpu fp32') with RWKV_V7_ON=1 RWKV_CUDA_ON=0")
    rec.metric("shape", result["spec"])
    ok = True
    for i, name in enumerate("ABC"):
        got, plain, ref = result["cached"][i], result["uncached"][i], result["ref"][i]
        row = got["rows"][0]
        rec.metric(f"{name}.prompt_len", len(row["prompt_ids"]))
        rec.metric(f"{name}.num_cached_tokens", row["num_cached_tokens"])
        rec.metric(f"{name}.prefix_cache_hits", got["hits"])
        rec.metric(f"{name}.prefix_cache_queries", got["queries"])
        d_plain, d_ref = _diff(row["logits"], plain["rows"][0]["logits"]), _diff(row["logits"], ref)
        rec.metric(f"{name}.max_abs_diff_vs_uncached", d_plain)
        rec.metric(f"{name}.max_abs_diff_vs_rwkv", d_ref)
        ok &= rec.check(
            f"{name}: logits within {TOL} of the uncached engine and the rwkv package", max(d_plain, d_ref) < TOL
        )
        ok &= rec.check(
            f"{name}: greedy tokens identical to the uncached engine", row["gen_ids"] == plain["rows"][0]["gen_ids"]
        )
    ok &= rec.check(
        f"B (shares {SHARED} tokens = 3 whole blocks with A) resumes from the cached state",
        result["cached"][1]["rows"][0]["num_cached_tokens"] == SHARED and result["cached"][1]["hits"] >= SHARED,
    )
    ok &= rec.check(
        "C (diverges inside block 4) reuses exactly the 3 whole blocks",
        result["cached"][2]["rows"][0]["num_cached_tokens"] == SHARED,
    )
    rec.skip("NPU", "no Ascend NPU here; the state-block copy ran through memmove on CPU")
    path = rec.write(evidence_root)
    assert ok and path.exists()
