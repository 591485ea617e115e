"""DeepSeek-V4 drafts with its own MTP layer through vLLM's speculative decoding (``method: mtp``).

In process (no engine): the start-up policy routes the draft model to the adapter's drafter on the names
each engine gives it and refuses what it cannot serve; the drafter loads exactly its MTP layer
(``mtp.0.*`` in DeepSeek's names, float or DeepSeek's FP8/FP4 release) and refuses a checkpoint that lost
a tensor, naming it; its logits over a prefill and a decode step equal an independent reference of the MTP
block (``_dsv4_mtp_ref``: DeepSeek's published MTP math around transformers' decoder layer).

Served (compiled, vLLM's default), at TP=1 and TP=2, on the bench's checkpoint whose MTP layer was fitted
to its own model (``mtp_fit.make_deepseek_v4_mtp_fitted`` of the test layer): greedy tokens and target
logits equal transformers' while drafts are accepted at every draft position and rejected (rejected drafts
roll back), and the acceptance per position does not fall below the bench record's
(``bench-deepseek_v4-mtp``). A ModelSlim W8A8 export whose description quantizes some MTP entries, marks
some FLOAT and omits the rest serves with MTP against the quantized reference.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ascend_adapters.deepseek_v4.tiny import TINY_CONFIG, make_tiny
from ascend_adapters.testing.modelslim import DEEPSEEK_V4_W8A8_PLAN as W8A8_PLAN
from ascend_adapters.testing.mtp_fit import DEEPSEEK_V4_HEAD_SCALE
from ascend_adapters.testing.w8a8_reference import FOLLOWING


def _mtp_config(architectures, num_nextn_predict_layers=1, pp=1):
    hf = SimpleNamespace(
        architectures=list(architectures),
        num_nextn_predict_layers=num_nextn_predict_layers,
        layer_types=list(TINY_CONFIG["layer_types"]),
        compress_rates=dict(TINY_CONFIG["compress_rates"]),
    )
    draft = SimpleNamespace(hf_config=hf, hf_text_config=hf)
    spec = SimpleNamespace(method="mtp", draft_model_config=draft, arch_updates=[])
    spec.update_arch_ = lambda: spec.arch_updates.append(list(hf.architectures))
    return SimpleNamespace(speculative_config=spec, parallel_config=SimpleNamespace(pipeline_parallel_size=pp))


@pytest.mark.parametrize("engine_name", ["DeepSeekV4MTPModel", "DeepSeekMTPModel"])
def test_mtp_draft_is_routed_to_the_adapters_drafter(engine_name):
    """vLLM names the draft of a deepseek_v4 target DeepSeekV4MTPModel (its config parser applies the
    override twice on this adapter's config, so the second pass names DeepSeekMTPModel); the policy points
    it at the adapter's drafter, puts compress_ratios back (vLLM's proposer widens its hidden buffer to
    hc_mult streams only when the draft config has it) and tells vLLM."""
    from ascend_adapters.deepseek_v4 import DRAFT_ARCHITECTURES
    from ascend_adapters.deepseek_v4.policy import route_mtp_draft

    cfg = _mtp_config([engine_name])
    route_mtp_draft(cfg)
    assert cfg.speculative_config.arch_updates == [list(DRAFT_ARCHITECTURES)]
    assert cfg.speculative_config.draft_model_config.hf_config.compress_ratios == [0, 4, 16, 4]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"architectures": ["SomeOtherMTPModel"]}, r"names the MTP draft \['SomeOtherMTPModel'\]"),
        ({"architectures": ["DeepSeekV4MTPModel"], "num_nextn_predict_layers": 0}, "num_nextn_predict_layers is 0"),
        ({"architectures": ["DeepSeekV4MTPModel"], "pp": 2}, "pipeline_parallel_size=2 is not served"),
    ],
    ids=["unknown-engine-draft", "no-mtp-layer", "pipeline-parallel"],
)
def test_mtp_refusals_name_the_reason(kwargs, message):
    from ascend_adapters.deepseek_v4.policy import route_mtp_draft

    with pytest.raises(ValueError, match=message):
        route_mtp_draft(_mtp_config(**kwargs))


def test_speculative_methods_other_than_mtp_are_refused_in_one_line(tmp_path):
    from ascend_adapters.deepseek_v4.policy import check_startup

    spec = SimpleNamespace(method="ngram", num_speculative_tokens=3)
    hf = make_tiny(tmp_path / "tiny")
    from ascend_adapters.deepseek_v4.config import load_transformers_config

    mc = SimpleNamespace(
        hf_config=load_transformers_config(hf), model=str(hf), max_model_len=64, quantization=None, dtype=torch.float32
    )
    cfg = SimpleNamespace(
        speculative_config=spec, model_config=mc, cache_config=SimpleNamespace(enable_prefix_caching=False)
    )
    with pytest.raises(ValueError, match=r"speculative decoding method 'ngram' is not served .*served: mtp"):
        check_startup(cfg)


@pytest.fixture(scope="module")
def drafter_case(tmp_path_factory):
    """The drafter (``mtp.DeepseekV4MTP``) built for the tiny checkpoint with its MTP layer, and the
    checkpoint's tensors."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.torch_utils import set_default_torch_dtype

    from ascend_adapters.deepseek_v4 import register
    from ascend_adapters.deepseek_v4.mtp import DeepseekV4MTP
    from ascend_adapters.testing.inprocess import ensure_single_rank_parallel_state
    from ascend_adapters.testing.parity import DEFAULT_LLM_KWARGS

    register()
    ckpt = make_tiny(tmp_path_factory.mktemp("dsv4_drafter") / "tiny", seed=4, mtp=True)
    kwargs = {
        **DEFAULT_LLM_KWARGS,
        "max_model_len": 64,
        "speculative_config": {"method": "mtp", "num_speculative_tokens": 2},
    }
    vllm_config = EngineArgs(model=str(ckpt), **kwargs).create_engine_config()
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.float32):
        ensure_single_rank_parallel_state()
        drafter = DeepseekV4MTP(vllm_config=vllm_config)
    return drafter, dict(sorted(load_file(str(ckpt / "model.safetensors")).items()))


def test_drafter_loads_its_layer_and_skips_the_rest(drafter_case):
    drafter, tensors = drafter_case
    loaded = drafter.load_weights(tensors.items())
    assert loaded == set(dict(drafter.named_parameters()))
    assert all(n.startswith("model.layers.4.") for n in loaded)
    assert "owns only its MTP layers" in drafter.skipped_weights["model.layers.0.attn.wq_a.weight"]


@pytest.mark.parametrize(
    "name, param",
    [
        ("mtp.0.e_proj.weight", "model.layers.4.e_proj.weight"),
        ("mtp.0.hnorm.weight", "model.layers.4.hnorm.weight"),
        ("mtp.0.hc_head_fn", "model.layers.4.hc_head.hc_fn"),
        ("mtp.0.norm.weight", "model.layers.4.shared_head.norm.weight"),
        ("mtp.0.attn.wkv.weight", "kv_proj"),
    ],
)
def test_drafter_missing_mtp_tensor_is_an_error_naming_it(drafter_case, name, param):
    """An export whose MTP layer lost a tensor does not serve a half-loaded drafter."""
    drafter, tensors = drafter_case
    with pytest.raises(Exception, match=rf"DeepSeek-V4 MTP checkpoint lacks 1 .*{re.escape(param)}"):
        drafter.load_weights([(n, t) for n, t in tensors.items() if n != name])


def test_drafter_loads_deepseeks_fp8_release(tmp_path):
    """DeepSeek's release layout (``tiny.write_release``): the MTP layer's e_proj/h_proj and attention in FP8
    blocks, its experts in FP4. The drafter dequantizes them at load; its e_proj equals the release's bits
    decoded by the release test's own decoder (no adapter code)."""
    from safetensors.torch import load_file
    from test_deepseek_v4_release import _reference_weight
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.torch_utils import set_default_torch_dtype

    from ascend_adapters.deepseek_v4 import register
    from ascend_adapters.deepseek_v4.mtp import DeepseekV4MTP
    from ascend_adapters.deepseek_v4.tiny import write_release
    from ascend_adapters.testing.inprocess import ensure_single_rank_parallel_state
    from ascend_adapters.testing.parity import DEFAULT_LLM_KWARGS

    register()
    hca128 = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    release = write_release(make_tiny(tmp_path / "hf", seed=6, mtp=True, compress_rates=hca128), tmp_path / "rel")
    tensors = load_file(str(release / "model.safetensors"))
    assert tensors["mtp.0.e_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["mtp.0.ffn.experts.0.w1.weight"].dtype == torch.int8
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    kwargs = {**DEFAULT_LLM_KWARGS, "max_model_len": 64, "speculative_config": spec}
    vllm_config = EngineArgs(model=str(release), **kwargs).create_engine_config()
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.float32):
        ensure_single_rank_parallel_state()
        drafter = DeepseekV4MTP(vllm_config=vllm_config)
    assert drafter.load_weights(tensors.items()) == set(dict(drafter.named_parameters()))
    want = _reference_weight(tensors["mtp.0.e_proj.weight"], tensors["mtp.0.e_proj.scale"])
    assert torch.equal(drafter.model.layers["4"].e_proj.weight, want)


def test_drafter_leaves_the_quant_config_it_is_handed_as_it_is(tmp_path):
    """vLLM hands the drafter the target's ``vllm_config`` (its quantization config included): the drafter
    maps a W8A8 export's ``mtp.K.*`` description to its own layer names on a copy, so the target's config
    keeps its description and renames, and the drafter's layers are quantized as the export says."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.torch_utils import set_default_torch_dtype

    from ascend_adapters.deepseek_v4 import register
    from ascend_adapters.deepseek_v4.mtp import DeepseekV4MTP
    from ascend_adapters.testing.inprocess import ensure_single_rank_parallel_state
    from ascend_adapters.testing.modelslim import export_w8a8
    from ascend_adapters.testing.parity import DEFAULT_LLM_KWARGS

    register()
    export = export_w8a8(make_tiny(tmp_path / "tiny", seed=4, mtp=True), tmp_path / "w8a8", MTP_PLAN)
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    kwargs = {**DEFAULT_LLM_KWARGS, "max_model_len": 64, "speculative_config": spec, "quantization": "modelslim"}
    vllm_config = EngineArgs(model=str(export), **kwargs).create_engine_config()
    handed = vllm_config.quant_config
    types, renames = dict(handed.description.types), list(handed._renames)
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.float32):
        ensure_single_rank_parallel_state()
        drafter = DeepseekV4MTP(vllm_config=vllm_config)
    assert vllm_config.quant_config is handed
    assert handed.description.types == types and handed._renames == renames
    assert type(drafter.model.layers["4"].e_proj.quant_method).__name__ != "UnquantizedLinearMethod"


# -- the drafter against the independent reference ---------------------------------------------------

TOL = 1e-3  # the eager parity gate's bound (test_deepseek_v4_parity.TOL)


@pytest.fixture(scope="module")
def inprocess_drafter(tmp_path_factory):
    from _dsv4_mtp_ref import MtpReference

    from ascend_adapters.deepseek_v4 import register
    from ascend_adapters.deepseek_v4.mtp import DeepseekV4MTP
    from ascend_adapters.testing.mtp_fit import inprocess_target_and_drafter

    ckpt = make_tiny(tmp_path_factory.mktemp("dsv4_mtp_ref") / "tiny", seed=4, mtp=True)
    register()
    cfg, _, drafter = inprocess_target_and_drafter(ckpt, DeepseekV4MTP, max_model_len=128)
    for layer in drafter.model.layers.values():
        for cache in layer.self_attn.caches.values():  # block 0 is vLLM's null block; the request has the rest
            blocks = 1 + -(-cfg.model_config.max_model_len // cache.geometry.block_size)
            cache.kv_cache = torch.zeros(blocks, cache.rows_per_block, cache.geometry.width)
    return cfg, drafter, MtpReference(ckpt)


def _metadata(cache, query_len: int, first_position: int):
    from ascend_adapters.deepseek_v4.backend import step_metadata, step_segments

    qsl = torch.tensor([0, query_len])
    table = torch.arange(1, cache.kv_cache.shape[0])[None]
    return step_metadata(qsl, table, first_position + query_len, step_segments(qsl, decode_threshold=1))


@pytest.mark.vllm
def test_drafter_logits_equal_the_mtp_reference(inprocess_drafter):
    """A prefill of 40 positions (beyond the window of 16: the MTP layer attends over its own window),
    then one decode step; the drafter is fed the target's streams from transformers."""
    from _dsv4_cases import prompts
    from vllm.forward_context import set_forward_context

    cfg, drafter, ref = inprocess_drafter
    (layer,) = drafter.model.layers.values()
    ids = prompts([42], seed=5)[0]
    streams = ref.streams(ids)  # [42, hc, h]
    want = ref(ids, streams)  # [41, V]: row i predicts token i + 2
    flat = streams.flatten(1)
    m = 40
    caches = list(layer.self_attn.caches.values())
    with torch.inference_mode():
        with set_forward_context({c.layer_name: _metadata(c, m, 0) for c in caches}, cfg, num_tokens=m):
            prefill = drafter.compute_logits(drafter.forward(torch.tensor(ids[1 : m + 1]), torch.arange(m), flat[:m]))
        with set_forward_context({c.layer_name: _metadata(c, 1, m) for c in caches}, cfg, num_tokens=1):
            out = drafter.forward(torch.tensor([ids[m + 1]]), torch.tensor([m]), flat[m : m + 1])
        decode = drafter.compute_logits(out)
    got = torch.cat([prefill, decode])
    diff = float((got - want[: m + 1]).abs().max())
    assert diff < TOL, diff
    assert got.argmax(-1).tolist() == want[: m + 1].argmax(-1).tolist()


# -- served ----------------------------------------------------------------------------------------

DRAFTS = 2
LENGTHS = (7, 16, 61, 150)  # window 16; CSA rate 4 with indexer top-k, HCA rate 16
MAX_TOKENS = 24
LLM_KWARGS = {
    "dtype": "float32",
    "enforce_eager": False,
    "max_model_len": 256,
    "kv_cache_memory_bytes": 64 << 20,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 32,
    "speculative_config": {"method": "mtp", "num_speculative_tokens": DRAFTS},
}
BENCH_RECORD = Path(__file__).resolve().parents[3] / "evidence" / "deepseek_v4" / "bench-deepseek_v4-mtp.json"


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """The bench's checkpoint: the tiny model with its MTP layer fitted to predict its own token after next
    (``mtp_fit.make_deepseek_v4_mtp_fitted``), and the transformers reference of its target."""
    from _dsv4_cases import hf_model, reference_fn

    from ascend_adapters.testing.mtp_fit import make_deepseek_v4_mtp_fitted

    ckpt, fit = make_deepseek_v4_mtp_fitted(tmp_path_factory.mktemp("dsv4_mtp") / "fitted")
    return ckpt, reference_fn(hf_model(ckpt)), fit


def _serve(ckpt, ref, llm_kwargs, env=None) -> dict:
    """Four prompts batched (chunked prefill), then the longest and the shortest alone; per row the worst
    logit difference to ``ref`` and whether the greedy tokens are ``ref``'s; vLLM's counters summed."""
    import time

    from _dsv4_cases import prompts

    from ascend_adapters.testing.engine_worker import engine_run

    started = time.time()
    ps = prompts(LENGTHS, seed=11)
    batches = engine_run(ckpt, [ps, [ps[-1]], [ps[0]]], MAX_TOKENS, llm_kwargs, env)
    worst, identical = 0.0, True
    for batch in batches:
        for row in batch["rows"]:
            t = len(row["prompt_ids"])
            want = ref(row["prompt_ids"] + row["gen_ids"][:-1])[t - 1 :]
            vocab = min(want.shape[-1], row["logits"].shape[-1])
            worst = max(worst, float((row["logits"][:, :vocab] - want[:, :vocab]).abs().max()))
            identical &= row["gen_ids"] == want[:, :vocab].argmax(-1).tolist()
    first = batches[0]["counters"]
    c = {k: sum(b["counters"].get(k, 0) for b in batches) for k in first if not isinstance(first[k], list)}
    per_pos = [
        sum(b["counters"]["vllm:spec_decode_num_accepted_tokens_per_pos"][j] for b in batches) for j in range(DRAFTS)
    ]
    same = batches[0]["rows"][-1]["gen_ids"] == batches[1]["rows"][0]["gen_ids"]
    same &= batches[0]["rows"][0]["gen_ids"] == batches[2]["rows"][0]["gen_ids"]
    return {"started": started, "worst": worst, "identical": identical, "batched_equals_alone": same,
            "counters": c, "accepted_per_position": per_pos}  # fmt: skip


def _record(run: dict, gate: str, llm_kwargs: dict):
    from ascend_adapters.common.evidence import EvidenceRecord

    rec = EvidenceRecord(model="deepseek_v4", gate=gate, started=run["started"])
    rec.command(
        f"vllm.LLM(<mtp_fit.make_deepseek_v4_mtp_fitted>, {llm_kwargs}): 4 prompts batched (chunked prefill), "
        "then the longest and the shortest alone; reference transformers DeepseekV4ForCausalLM float32"
    )
    c = run["counters"]
    rec.metric("max_abs_logit_diff", run["worst"])
    rec.metric("spec_decode_counters", c)
    rec.metric("accepted_per_position", run["accepted_per_position"])
    rec.check(f"target logits within {TOL} of transformers (batched, chunked, alone)", run["worst"] < TOL)
    rec.check("greedy tokens are transformers' greedy tokens", run["identical"])
    rec.check("batched tokens equal the single-prompt tokens", run["batched_equals_alone"])
    rec.check(
        f"drafts accepted at every one of the {DRAFTS} draft positions",
        c.get("vllm:spec_decode_num_drafts", 0) > 0 and all(n > 0 for n in run["accepted_per_position"]),
        run["accepted_per_position"],
    )
    rec.check(
        "drafts rejected (the rollback path ran)",
        c.get("vllm:spec_decode_num_accepted_tokens", 0) < c.get("vllm:spec_decode_num_draft_tokens", 0),
        c,
    )
    return rec


@pytest.fixture(scope="module")
def served(fitted):
    return _serve(fitted[0], fitted[1], LLM_KWARGS)


@pytest.mark.vllm
@pytest.mark.gate
def test_mtp_served_parity(served, evidence_root):
    """Served compiled with 2 drafts from the fitted MTP layer: four prompts batched with chunked prefill,
    then the longest and the shortest alone. The target's logits at every generated step match transformers
    within the parity bound and its greedy tokens are transformers' (so those of decoding without MTP);
    vLLM's counters show drafts accepted at both positions and drafts rejected, so the rings' rollback
    slack is exercised (with no slack the tokens differ: seen on all three engines)."""
    rec = _record(served, "mtp_parity", LLM_KWARGS)
    rec.write(evidence_root)
    assert rec.passed, rec.checks


@pytest.mark.vllm
@pytest.mark.gate
def test_mtp_served_parity_tp2(fitted, evidence_root):
    from ascend_adapters.testing.parity import two_rank_cpu_bind

    env = two_rank_cpu_bind("tensor parallelism 2")
    kwargs = {**LLM_KWARGS, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    rec = _record(_serve(fitted[0], fitted[1], kwargs, env), "mtp_parity_tp2", kwargs)
    rec.write(evidence_root)
    assert rec.passed, rec.checks


def acceptance_floor(record_rate: float, drafts: int) -> float:
    """Three binomial standard errors below the record's rate, for ``drafts`` drafts measured here."""
    return record_rate - 3 * math.sqrt(record_rate * (1 - record_rate) / drafts)


@pytest.mark.vllm
def test_acceptance_does_not_fall_below_the_bench_record(fitted, served):
    """The served gate's acceptance per draft position, on the bench's fitted checkpoint, is not below
    the bench record's by more than three binomial standard errors of the drafts counted here (the
    prompts differ, so the rates agree only in distribution)."""
    record = json.loads(BENCH_RECORD.read_text())
    mtp = record["metrics"]["mtp"]
    same_fit = {k: mtp["fit"][k] for k in ("steps", "sequences")} == {k: fitted[2][k] for k in ("steps", "sequences")}
    assert same_fit, ("the bench record was measured on another fit: rerun the bench", mtp["fit"], fitted[2])
    drafts = served["counters"]["vllm:spec_decode_num_drafts"]
    measured = [n / drafts for n in served["accepted_per_position"]]
    floors = [acceptance_floor(r, drafts) for r in mtp["acceptance_per_position"]]
    assert all(m >= f for m, f in zip(measured, floors)), {"measured": measured, "floors": floors, "record": mtp}


# MTP entries of a ModelSlim export in each state a description puts them: quantized (the MTP layer's
# attention and shared expert, by W8A8_PLAN's patterns), FLOAT (its routed experts), or left out of the
# description (its glue: e_proj / h_proj, norms, hc head; a tensor the description omits is FLOAT).
MTP_PLAN = {"mtp.*.ffn.experts.*": "FLOAT", **W8A8_PLAN}
OMITTED = re.compile(r"^mtp\.0\.([eh]_proj|enorm|hnorm|norm|hc_head_)")
# The W8A8 gate's bound (test_deepseek_v4_w8a8.TOL, 1e-3) is for logits at the tiny model's scale; the
# fitted checkpoint's head is that of a model scaled by DEEPSEEK_V4_HEAD_SCALE, which scales every logit
# difference alike (an int8 rounding that flips between the engine and the reference moves the logits
# by that factor more).
W8A8_TOL = 1e-3 * DEEPSEEK_V4_HEAD_SCALE


@pytest.mark.vllm
@pytest.mark.gate
def test_mtp_on_w8a8_export(fitted, tmp_path, evidence_root):
    """The fitted checkpoint exported W8A8_DYNAMIC with its MTP entries quantized, FLOAT and omitted, served
    eager with 2 drafts: the drafter loads its layer through the export's description (mapped to its own
    layer names) beside the quantized target; the target's logits match the quantized reference within the
    W8A8 gate's bound, and the acceptance per position is not below the float bench record's floor (a
    drafter that read its int8 weights wrongly would propose noise)."""
    from _dsv4_cases import compare_w8a8, prompts, w8a8_reference

    from ascend_adapters.common.evidence import EvidenceRecord
    from ascend_adapters.testing.engine_worker import engine_run
    from ascend_adapters.testing.modelslim import export_w8a8

    export = export_w8a8(fitted[0], tmp_path / "w8a8", MTP_PLAN)
    desc_path = export / "quant_model_description.json"
    desc = json.loads(desc_path.read_text())
    omitted = sorted(k for k in desc if OMITTED.match(k))
    desc = {k: v for k, v in desc.items() if k not in omitted}
    desc_path.write_text(json.dumps(desc, indent=2))
    linears = {k: v for k, v in desc.items() if k.startswith("mtp.") and k.endswith(".weight")}
    mtp_types = {
        kind: sorted({re.sub(r"\.\d+\.", ".*.", k[: -len(".weight")]) for k, v in linears.items() if v == kind})
        for kind in ("W8A8_DYNAMIC", "FLOAT")
    }
    rec = EvidenceRecord(model="deepseek_v4", gate="mtp_parity_w8a8")
    kwargs = {**LLM_KWARGS, "enforce_eager": True, "quantization": "modelslim"}
    (batch,) = engine_run(export, [prompts(LENGTHS, seed=5)], MAX_TOKENS, kwargs)
    quant = compare_w8a8(
        [(row["prompt_ids"], row["gen_ids"], row["logits"]) for row in batch["rows"]],
        w8a8_reference(fitted[0], MTP_PLAN),
        W8A8_TOL,
    )
    c = batch["counters"]
    drafts = c.get("vllm:spec_decode_num_drafts", 0)
    record = json.loads(BENCH_RECORD.read_text())["metrics"]["mtp"]["acceptance_per_position"]
    measured = [n / max(drafts, 1) for n in c["vllm:spec_decode_num_accepted_tokens_per_pos"]]
    floors = [acceptance_floor(r, max(drafts, 1)) for r in record]
    rec.command(f"mtp_fit.make_deepseek_v4_mtp_fitted + export_w8a8(plan={MTP_PLAN}), {len(omitted)} MTP entries "
                f"removed from the description; vllm.LLM(<export>, {kwargs}) greedy {MAX_TOKENS} tokens, "
                f"{len(LENGTHS)} prompts batched")  # fmt: skip
    rec.metric("mtp_layers_by_description_type", mtp_types)
    rec.metric("mtp_entries_omitted", omitted)
    rec.metric("max_abs_diff_vs_quantized_reference", quant["max_abs_diff"])
    rec.metric("spec_decode_counters", c)
    rec.metric("acceptance_per_position", {"measured": measured, "floor": floors, "bench_record": record})
    rec.check(
        "the export's MTP entries are quantized, FLOAT and omitted",
        all(mtp_types.values()) and omitted != [],
        {**mtp_types, "omitted": omitted},
    )
    rec.check(
        f"target logits within {W8A8_TOL} of the independently quantized reference, {FOLLOWING}",
        quant["within_bound"],
        quant["per_sequence"],
    )
    rec.check("greedy tokens identical to the quantized reference", quant["tokens_identical"])
    rec.check(
        "acceptance per draft position at or above the float bench record's floor (3 binomial standard errors)",
        drafts > 0 and all(m >= f for m, f in zip(measured, floors)),
        {"measured": measured, "floors": floors},
    )
    rec.write(evidence_root)
    assert rec.passed, rec.checks
