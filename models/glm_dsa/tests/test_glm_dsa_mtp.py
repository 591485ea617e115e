"""Gate: GLM-DSA drafts with its own MTP layer through vLLM's speculative decoding (``method: mtp``).

The checkpoint is ``mtp_fit.make_glm_dsa_mtp_fitted`` (the test layer's): the released layout with its MTP layer
(``model.layers.3.*``, plus GLM-5.1's copies of the embedding and head there, which the drafter skips
because vLLM's proposer shares the target's), the layer fitted to predict its own model's token after
next, so drafts are accepted and rejected.

Served (one engine, compiled, vLLM's default): 3 draft tokens (the one MTP layer reused), four prompts
of 3..100 tokens batched with chunked prefill (32 tokens per step; the sparse path),
then the longest and the shortest alone, 24 tokens each (contexts up to 124 tokens, under the fitted
checkpoint's index_topk 128: its greedy text repeats itself, so top-k scores nearly tie, see mtp_fit.GLM_DSA_FITTED;
the selection itself is tested in process below and in test_glm_dsa_compiled). The target's logits at every generated step
must match transformers on the same tokens within the compiled gate's bound, and its greedy tokens
must be transformers' (so identical to decoding without MTP, which the parity gates tie to the same
reference); vLLM's own counters must show drafts accepted at every draft position and some rejected.
The same again at TP=2.

Acceptance floor: the served run's acceptance rate per draft position must not fall below the MTP
bench record's rate (same checkpoint, other random prompts) by more than three binomial standard
errors of this run's draft count: ``rate_record - 3 * sqrt(r (1 - r) / drafts)``. A collapse (MTP
weights not loaded, wrong hidden states, wrong position) drops the rate to about zero.

In process (no engine), on the random tiny checkpoint (index_topk 8, no near-ties): the drafter's logits
over a 21-token prefill and one decode step equal the independent MTP reference (``_glm_dsa_mtp_ref``,
transformers' decoder layer) fed the same target hidden states; the decode step reads no device value on
the host.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
from _glm_dsa_mtp_ref import MtpReference
from _glm_dsa_ref import Reference, add_released_extras, build, random_prompts, step_metadata

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.testing.capture import HostReads
from ascend_adapters.testing.engine_worker import engine_run as run_engine
from ascend_adapters.testing.parity import two_rank_cpu_bind
from ascend_adapters.testing.w8a8_reference import FOLLOWING

DRAFTS = 3
MTP = {"method": "mtp", "num_speculative_tokens": DRAFTS}
LLM_KWARGS = {
    "dtype": "float32",
    "enforce_eager": False,
    "max_model_len": 160,
    "kv_cache_memory_bytes": 64 << 20,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 32,
    "block_size": 16,
    "speculative_config": MTP,
}
LENGTHS = (3, 21, 64, 100)
MAX_TOKENS = 24
TOL = 1e-3  # the compiled parity gate's bound (test_glm_dsa_compiled.TOL)
BENCH_RECORD = Path(__file__).resolve().parents[3] / "evidence" / "glm_dsa" / "bench_mtp_quick.json"


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    from ascend_adapters.testing.mtp_fit import make_glm_dsa_mtp_fitted

    ckpt, fit = make_glm_dsa_mtp_fitted(tmp_path_factory.mktemp("glm_dsa_mtp") / "fitted")
    add_released_extras(ckpt)
    return ckpt, fit


def engine_run(model_dir, runs, llm_kwargs, env=None) -> list[dict]:
    return run_engine(model_dir, runs, MAX_TOKENS, llm_kwargs, env)


def _judge(ckpt, batches) -> dict:
    ref = Reference(ckpt)
    per_row = []
    for batch in batches:
        for row in batch["rows"]:
            t = len(row["prompt_ids"])
            want = ref(row["prompt_ids"] + row["gen_ids"][:-1])[t - 1 :]
            vocab = min(want.shape[-1], row["logits"].shape[-1])
            per_row.append(
                {
                    "prompt_len": t,
                    "max_abs_diff": float((row["logits"][:, :vocab] - want[:, :vocab]).abs().max()),
                    "tokens_identical": row["gen_ids"] == want[:, :vocab].argmax(-1).tolist(),
                }
            )
    counters = [b["counters"] for b in batches]
    total = {k: sum(c.get(k, 0) for c in counters) for k in counters[0] if not isinstance(counters[0][k], list)}
    per_pos = [sum(c["vllm:spec_decode_num_accepted_tokens_per_pos"][j] for c in counters) for j in range(DRAFTS)]
    same = batches[0]["rows"][-1]["gen_ids"] == batches[1]["rows"][0]["gen_ids"]
    same &= batches[0]["rows"][0]["gen_ids"] == batches[2]["rows"][0]["gen_ids"]
    return {"per_row": per_row, "counters": total, "accepted_per_position": per_pos, "batched_equals_alone": same}


def _serve(ckpt, llm_kwargs, env=None) -> dict:
    ps = random_prompts(LENGTHS, seed=21)
    return _judge(ckpt, engine_run(ckpt, [ps, [ps[-1]], [ps[0]]], llm_kwargs, env))


@pytest.fixture(scope="module")
def served(fitted):
    started = time.time()
    return {"started": started, **_serve(fitted[0], LLM_KWARGS)}


def _checks(rec, run, label) -> bool:
    worst = max(r["max_abs_diff"] for r in run["per_row"])
    c = run["counters"]
    rec.metric(f"{label}_max_abs_logit_diff", worst)
    rec.metric(f"{label}_spec_decode_counters", c)
    rec.metric(f"{label}_accepted_per_position", run["accepted_per_position"])
    ok = rec.check(f"{label}: target logits within {TOL} of transformers (batched, chunked, alone)", worst < TOL)
    ok &= rec.check(
        f"{label}: greedy tokens are transformers' greedy tokens",
        all(r["tokens_identical"] for r in run["per_row"]),
        run["per_row"],
    )
    ok &= rec.check(f"{label}: batched tokens equal the single-prompt tokens", run["batched_equals_alone"])
    ok &= rec.check(
        f"{label}: drafts accepted at every one of the {DRAFTS} draft positions",
        c.get("vllm:spec_decode_num_drafts", 0) > 0 and all(n > 0 for n in run["accepted_per_position"]),
        run["accepted_per_position"],
    )
    ok &= rec.check(
        f"{label}: some drafts rejected",
        c.get("vllm:spec_decode_num_accepted_tokens", 0) < c.get("vllm:spec_decode_num_draft_tokens", 0),
        c,
    )
    return ok


@pytest.mark.vllm
@pytest.mark.gate
def test_mtp_served_parity(fitted, served, evidence_root):
    rec = EvidenceRecord(model="glm_dsa", gate="mtp_parity", started=served["started"])
    rec.command(
        f"mtp_fit.make_glm_dsa_mtp_fitted(OUT) + GLM-5.1 copies in the MTP layer; vllm.LLM(OUT, {LLM_KWARGS}, "
        f"logprobs_mode=raw_logits) greedy, {MAX_TOKENS} tokens, prompts of {LENGTHS} tokens batched, then "
        "the longest and the shortest alone"
    )
    rec.command("transformers GlmMoeDsaForCausalLM.from_pretrained(OUT) on the served tokens")
    rec.metric("mtp_fit", fitted[1])
    ok = _checks(rec, served, "tp1")
    rec.write(evidence_root)
    assert ok, rec.checks


@pytest.mark.vllm
@pytest.mark.gate
def test_mtp_served_parity_tp2(fitted, evidence_root):
    env = two_rank_cpu_bind("tensor parallelism 2")
    rec = EvidenceRecord(model="glm_dsa", gate="mtp_parity_tp2")
    kwargs = {**LLM_KWARGS, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    run = _serve(fitted[0], kwargs, env)
    rec.command(
        f"vllm.LLM(mtp_fit.make_glm_dsa_mtp_fitted(OUT), {kwargs}) greedy, {MAX_TOKENS} tokens, batched then alone"
    )
    ok = _checks(rec, run, "tp2")
    rec.write(evidence_root)
    assert ok, rec.checks


@pytest.fixture(scope="module")
def w8a8_export(fitted, tmp_path_factory):
    """ModelSlim W8A8 export of the fitted checkpoint: main layers quantized, the MTP layer FLOAT."""
    from _glm_dsa_w8a8 import make_export

    return make_export(fitted[0], tmp_path_factory.mktemp("glm_dsa_mtp_w8a8") / "w8a8", n_layers=3)


@pytest.mark.vllm
@pytest.mark.gate
def test_mtp_on_w8a8_export(fitted, w8a8_export, evidence_root):
    """A W8A8 export whose description marks the MTP layer FLOAT: the drafter loads it float beside the
    quantized target; the target's logits match the independently quantized reference within the W8A8
    gate's bound (eager, as that bound is derived: test_glm_dsa_w8a8.TOL)."""
    from _glm_dsa_w8a8 import compare_within_rounding, independent_reference

    rec = EvidenceRecord(model="glm_dsa", gate="mtp_parity_w8a8")
    desc = json.loads((w8a8_export / "quant_model_description.json").read_text())
    mtp_types = sorted({v for k, v in desc.items() if k.startswith("model.layers.3.") and k.endswith(".weight")})
    rec.metric("mtp_layer_description_types", mtp_types)
    kwargs = {**LLM_KWARGS, "enforce_eager": True, "quantization": "modelslim"}
    ps = random_prompts((5, 30), seed=5)
    (batch,) = engine_run(w8a8_export, [ps], kwargs)
    quant = compare_within_rounding(
        [(row["prompt_ids"], row["gen_ids"], row["logits"]) for row in batch["rows"]],
        independent_reference(fitted[0], n_layers=3),
        1e-4,
    )
    c = batch["counters"]
    rec.command(
        f"mtp_fit.make_glm_dsa_mtp_fitted + make_export (MTP FLOAT); vllm.LLM(<export>, {kwargs}) greedy {MAX_TOKENS}"
    )
    rec.metric("max_abs_diff_vs_quantized_reference", quant["max_abs_diff"])
    rec.metric("spec_decode_counters", c)
    ok = rec.check("the MTP layer is FLOAT in the description", mtp_types == ["FLOAT"], mtp_types)
    ok &= rec.check(f"target logits within 1e-4 of the independently quantized reference, {FOLLOWING}",
                    quant["within_bound"], quant["per_sequence"])  # fmt: skip
    ok &= rec.check("greedy tokens identical to the quantized reference", quant["tokens_identical"])
    ok &= rec.check("drafts accepted", c.get("vllm:spec_decode_num_accepted_tokens", 0) > 0, c)
    rec.write(evidence_root)
    assert ok, rec.checks


def acceptance_floor(record_rate: float, drafts: int) -> float:
    """Three binomial standard errors below the record's rate, for ``drafts`` drafts measured here."""
    return record_rate - 3 * math.sqrt(record_rate * (1 - record_rate) / drafts)


@pytest.mark.vllm
def test_acceptance_does_not_fall_below_the_bench_record(served):
    record = json.loads(BENCH_RECORD.read_text())
    rates = record["metrics"]["mtp"]["acceptance_per_position"]
    drafts = served["counters"]["vllm:spec_decode_num_drafts"]
    measured = [n / drafts for n in served["accepted_per_position"]]
    floors = [acceptance_floor(r, drafts) for r in rates]
    assert all(m >= f for m, f in zip(measured, floors)), {"measured": measured, "floors": floors, "record": rates}


# -- in process: the drafter against the independent MTP reference ------------------------------------------


@pytest.fixture(scope="module")
def inprocess_drafter(tmp_path_factory):
    from ascend_adapters.glm_dsa import register
    from ascend_adapters.glm_dsa.mtp import GlmMoeDsaMTP
    from ascend_adapters.testing.mtp_fit import inprocess_target_and_drafter

    ckpt = build(tmp_path_factory.mktemp("glm_dsa_drafter"), "tiny-sparse", index_topk=8)
    register()
    cfg, _, drafter = inprocess_target_and_drafter(ckpt, GlmMoeDsaMTP, max_model_len=160, block_size=16)
    for layer in drafter.model.layers.values():
        layer.self_attn.kv_cache = torch.zeros(8, 16, layer.self_attn.row_dim)
    return cfg, drafter, MtpReference(ckpt)


@pytest.mark.vllm
def test_drafter_logits_equal_the_mtp_reference(inprocess_drafter):
    from vllm.forward_context import set_forward_context

    cfg, drafter, ref = inprocess_drafter
    (layer,) = drafter.model.layers.values()
    ids = random_prompts([23], seed=5)[0]
    want = ref(ids)  # [22, V]: row i predicts token i + 2
    hidden = ref.hidden(ids)
    m = 21  # a prefill of positions 0..20 (more than index_topk 8: the indexer selects), then position 21
    names = [layer.self_attn.layer_name]
    with torch.inference_mode():
        with set_forward_context({n: step_metadata([m], [m]) for n in names}, cfg, num_tokens=m):
            prefill = drafter.compute_logits(drafter.forward(torch.tensor(ids[1 : m + 1]), torch.arange(m), hidden[:m]))
        mode = HostReads()
        with set_forward_context({n: step_metadata([1], [m + 1]) for n in names}, cfg, num_tokens=1), mode:
            out = drafter.forward(torch.tensor([ids[m + 1]]), torch.tensor([m]), hidden[m : m + 1])
        decode = drafter.compute_logits(out)
    got = torch.cat([prefill, decode])
    diff = float((got - want[: m + 1]).abs().max())
    assert diff < TOL, diff
    assert got.argmax(-1).tolist() == want[: m + 1].argmax(-1).tolist()
    # the drafter's routed experts are vLLM's fused MoE, whose CPU fallback may read (HostReads's docstring)
    assert mode.reads_outside_engine_moe() == [], (mode.outside, mode.inside)
