"""Gate: RWKV-7 with vLLM's n-gram speculative decoding; rejected drafts roll the recurrent state back.

Served: one engine, compiled (vLLM's default), ``speculative_config={"method": "ngram",
"num_speculative_tokens": 3, ...}``, on the self-repeating tiny checkpoint (``tiny.self_repeating``:
its greedy output falls into cycles the proposer drafts from, while its state still moves the
logits, so some drafts are rejected). Four prompts (3, 19, 66 and 90 tokens) together, then each
alone, 48 tokens each, 32 tokens per step: the 66- and 90-token prompts are prefilled in chunks,
and a 3-token prompt (or a 2-token last chunk) is no longer than 1 + 3 tokens, so vLLM schedules it
as a decode. Every generated step's logits must match the official ``rwkv`` package on the same
tokens within the parity gate's bound, and vLLM's own spec-decode counters must show drafts
accepted at every draft position and drafts rejected (both kinds of state rows were resumed from).
The same at tensor parallelism 2 (the prompts batched). Pipeline parallelism with speculation is refused
at start-up (vLLM builds the proposer on the last stage only).

Why the bound catches a wrong row: resuming from a neighbouring row feeds the time-mix a state one
token off, which moves the logits by about ``self_repeating``'s time-mix scale (5e-2) of their
spread (a few units): ~1e-1, three orders of magnitude above the bound.

In process (no engine): a decode step of four tokens (one token and three drafts) followed by a
step that accepted one draft reproduces the plain prompt forward of the accepted tokens; the
speculative decode step reads no device value on the host (``HostReads``), as the builder's
declared graph support (UNIFORM_BATCH) requires (``test_rwkv7_capture.py`` replays such a step captured).
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from _rwkv7_cases import CASES, build_case, build_inprocess_model, engine_configs, prompts, step_metadata
from _rwkv7_ref import rwkv_package_logits

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.testing.capture import HostReads
from ascend_adapters.testing.engine_worker import engine_run

CASE = "h64x2_l3"
LENGTHS = (3, 19, 66, 90)
MAX_TOKENS = 48
DRAFTS = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": DRAFTS, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
LLM_KWARGS = {
    "dtype": "float32",
    "enforce_eager": False,
    "max_model_len": 256,
    "kv_cache_memory_bytes": 64 << 20,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 32,
    "speculative_config": NGRAM,
}
TOL = 1e-4  # the parity gate's bound (test_rwkv7_parity.py)


def _serve(root, llm_kwargs, alone: bool, env=None) -> dict:
    """The four prompts together (then each alone with ``alone``) on one engine; per row the worst logit
    difference to the ``rwkv`` package and whether the greedy tokens are its; vLLM's counters summed."""
    started = time.time()
    spec = CASES[CASE]
    pth, hf_dir = build_case(root, CASE, repeating=True)
    ps = prompts(spec["vocab"], LENGTHS, seed=spec["seed"])
    batches = engine_run(hf_dir, [ps] + ([[p] for p in ps] if alone else []), MAX_TOKENS, llm_kwargs, env)
    rows = [row for batch in batches for row in batch["rows"]]
    refs = rwkv_package_logits(pth, [r["prompt_ids"] + r["gen_ids"][:-1] for r in rows])
    per_row = []
    for row, ref in zip(rows, refs):
        ref_gen = ref[len(row["prompt_ids"]) - 1 :]
        vocab = min(ref_gen.shape[-1], row["logits"].shape[-1])
        per_row.append(
            {
                "prompt_len": len(row["prompt_ids"]),
                "max_abs_diff": float((row["logits"][:, :vocab] - ref_gen[:, :vocab]).abs().max()),
                "tokens_identical": row["gen_ids"] == ref_gen[:, :vocab].argmax(-1).tolist(),
            }
        )
    counters = [b["counters"] for b in batches]
    total = {k: sum(c.get(k, 0) for c in counters) for k in counters[0] if not isinstance(counters[0][k], list)}
    per_pos = [sum(c["vllm:spec_decode_num_accepted_tokens_per_pos"][j] for c in counters) for j in range(DRAFTS)]
    return {"started": started, "per_row": per_row, "counters": total, "accepted_per_position": per_pos}


def _record(served: dict, gate: str, llm_kwargs: dict, what: str):
    rec = EvidenceRecord(model="rwkv7", gate=gate, started=served["started"])
    rec.command(
        f"vllm.LLM(OUT_DIR, {llm_kwargs}, logprobs_mode=raw_logits) greedy, {MAX_TOKENS} tokens, prompts of "
        f"{LENGTHS} tokens {what}; tiny.self_repeating checkpoint"
    )
    rec.command("rwkv.model.RWKV(SRC, 'cpu fp32') with RWKV_V7_ON=1 RWKV_CUDA_ON=0")
    c = served["counters"]
    rec.metric("spec_decode_counters", c)
    rec.metric("accepted_per_position", served["accepted_per_position"])
    worst = max(r["max_abs_diff"] for r in served["per_row"])
    rec.metric("max_abs_logit_diff", worst)
    rec.check(f"generated-step logits within {TOL} of the rwkv package ({what}, chunked)", worst < TOL)
    rec.check("greedy tokens identical to the rwkv package", all(r["tokens_identical"] for r in served["per_row"]))
    rec.check("drafts accepted at every draft position", all(n > 0 for n in served["accepted_per_position"]))
    rec.check(
        "drafts rejected (the state rolled back)",
        c["vllm:spec_decode_num_accepted_tokens"] < c["vllm:spec_decode_num_draft_tokens"],
    )
    rec.skip("NPU", "no Ascend NPU here")
    return rec


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return _serve(tmp_path_factory.mktemp("rwkv7-ngram"), LLM_KWARGS, alone=True)


@pytest.mark.vllm
def test_speculative_logits_and_tokens_match_rwkv_package(served):
    for i, row in enumerate(served["per_row"]):
        assert row["max_abs_diff"] < TOL and row["tokens_identical"], (i, row)


@pytest.mark.vllm
def test_drafts_were_accepted_at_every_position_and_some_rejected(served):
    c = served["counters"]
    assert c["vllm:spec_decode_num_drafts"] > 0, c
    # every draft position accepted at least once: the next step resumed from rows 1..3
    assert all(n > 0 for n in served["accepted_per_position"]), served["accepted_per_position"]
    # some drafts rejected: the state rolled back over tokens that were computed
    assert c["vllm:spec_decode_num_accepted_tokens"] < c["vllm:spec_decode_num_draft_tokens"], c


@pytest.mark.vllm
@pytest.mark.gate
def test_speculative_gate_evidence(served, evidence_root):
    rec = _record(served, "speculative_ngram", LLM_KWARGS, "batched then each alone")
    path = rec.write(evidence_root)
    assert rec.passed and path.exists(), rec.checks


@pytest.mark.vllm
@pytest.mark.gate
def test_speculative_tp2_gate_evidence(tmp_path, evidence_root):
    """The same gate at tensor parallelism 2 (each rank holds one of the two heads and its state rows),
    the four prompts batched: each rank rolls its own state rows back by the same accepted counts."""
    from ascend_adapters.testing.parity import two_rank_cpu_bind

    env = two_rank_cpu_bind("tensor parallelism 2")
    kwargs = {**LLM_KWARGS, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    rec = _record(_serve(tmp_path, kwargs, alone=False, env=env), "speculative_ngram_tp2", kwargs, "batched")
    path = rec.write(evidence_root)
    assert rec.passed and path.exists(), rec.checks


@pytest.mark.vllm
def test_unsupported_speculation_is_refused_at_startup(tmp_path):
    _, hf_dir = build_case(tmp_path, CASE)
    out = engine_configs(
        [
            ["ngram", str(hf_dir), {"speculative_config": NGRAM}],
            ["ngram_prefix", str(hf_dir), {"speculative_config": NGRAM, "enable_prefix_caching": True}],
            ["ngram_pp2", str(hf_dir), {"speculative_config": NGRAM, "pipeline_parallel_size": 2}],
        ],
        tmp_path,
    )
    assert out["ngram"] == "OK", out
    assert "speculative decoding with prefix caching is not supported" in out["ngram_prefix"], out
    assert "speculative decoding with pipeline_parallel_size=2 is not supported" in out["ngram_pp2"], out


# -- in process: rollback and capture safety ------------------------------------------------------


@pytest.fixture(scope="module")
def inprocess_model(tmp_path_factory):
    _, ckpt = build_case(tmp_path_factory.mktemp("rwkv7_rollback"), CASE, repeating=True)
    return build_inprocess_model(ckpt, state_rows=12)


def _metadata(q_lens, seq_lens, rows, num_decodes):
    """The backend's metadata for requests with ``q_lens`` tokens (decodes first) and state ``rows``."""
    q_cpu = [0, *itertools.accumulate(q_lens)]
    return step_metadata(
        q_cpu, num_decodes, torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(rows, dtype=torch.int32)
    )


def _hidden(cfg, model, md, tokens):
    from vllm.forward_context import set_forward_context

    with torch.inference_mode(), set_forward_context({layer.prefix: md for layer in model.model.layers}, cfg):
        return model.model.forward(torch.tensor(tokens), torch.zeros(len(tokens), dtype=torch.long)).clone()


def test_rejected_drafts_roll_back(inprocess_model):
    cfg, model = inprocess_model
    prompt, step1, step2 = [11, 12, 13, 14, 15], [21, 22, 23, 24], [31, 32]
    rows_a, rows_b = [0, 1, 2, 3], [4, 5, 6, 7]
    # request A: the prompt, a step of one token and three drafts, of which one is accepted, then two more
    _hidden(cfg, model, _metadata([5], [5], [rows_a], 0), prompt)
    first = _hidden(cfg, model, _metadata([4], [9], [rows_a], 1), step1)
    resumed = _hidden(cfg, model, _metadata([2], [9], [rows_a], 1), step2)
    # request B: the accepted tokens as one plain prompt
    plain = _hidden(cfg, model, _metadata([9], [9], [rows_b], 0), prompt + step1[:2] + step2)
    torch.testing.assert_close(first[:2], plain[5:7], rtol=0, atol=1e-5)
    torch.testing.assert_close(resumed, plain[7:9], rtol=0, atol=1e-5)


def test_speculative_decode_step_reads_no_device_value_on_host(inprocess_model):
    cfg, model = inprocess_model
    # three decodes: four tokens (a fresh request), one token, three tokens
    md = _metadata([4, 1, 3], [4, 20, 33], [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], 3)
    mode = HostReads()
    with mode:
        _hidden(cfg, model, md, [3, 5, 9, 2, 7, 1, 4, 6])
    assert mode.seen == [], mode.seen
