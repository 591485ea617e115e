"""`vllm serve DIR` on DeepSeek-V4 checkpoints, and start-up that fails closed on bad input.

* config.json exactly as transformers saves it, and DeepSeek's own config keys with native tensor
  names (no ``model.`` prefix, fused ``fused_wqa_wkv``, MTP tensors), both without --hf-overrides;
  greedy tokens over HTTP equal transformers' greedy continuation.
* bad inputs: a prompt longer than max_model_len (HTTP 400); a native tensor no rule maps
  (start-up stops naming it); max_model_len beyond the sliding window with the compressed
  branches switched off; ModelSlim exports with an unknown type or a missing companion.
* DeepSeek's published layout at max_model_len 1M in 768 MiB of KV cache: 16 short requests at
  once, tokens equal transformers', a long prompt's prefix served from the cache.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from _dsv4_cases import hf_greedy, hf_model, kv8_reference_fn, make_native_hca128, prompts

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.common.server import CPU_TEST_ARGS, ServerStartError, VllmServer
from ascend_adapters.deepseek_v4.tiny import make_tiny

N_TOKENS = 8


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv4s")
    tiny = make_tiny(root / "tiny", seed=7)
    hf128, native = make_native_hca128(root)
    return {"tiny": tiny, "hf128": hf128, "native": native, "root": root}


def _served_ids(srv, ids):
    # ignore_eos: the reference generates N_TOKENS whatever it emits (the tiny tokenizer's eos id is an
    # ordinary token of this random model; the 150-token prompt reaches it)
    r = srv.complete(ids, max_tokens=N_TOKENS, logprobs=1, return_tokens_as_token_ids=True, ignore_eos=True)
    return [int(t.split(":", 1)[1]) for t in r["choices"][0]["logprobs"]["tokens"]]


def _greedy_gate(model_dir, ref_dir, gate, evidence_root, extra_checks=None, lengths=(6, 40)):
    rec = EvidenceRecord(model="deepseek_v4", gate=gate)
    model = hf_model(ref_dir)
    ps = prompts(lengths, seed=21)
    with VllmServer(model_dir, startup_timeout=600) as srv:
        rec.command(" ".join(srv.cmd))
        rec.metric("startup_s", round(srv.timings.startup_s, 1))
        results = []
        for p in ps:
            got, want = _served_ids(srv, p), hf_greedy(model, p, N_TOKENS)
            results.append({"prompt_len": len(p), "served": got, "reference": want})
        rec.metric("greedy", results)
        ok = rec.check(
            "served greedy tokens == transformers greedy", all(r["served"] == r["reference"] for r in results)
        )
        if extra_checks:
            extra_checks(srv, rec)
    rec.write(evidence_root)
    assert rec.passed, rec.checks
    return ok


@pytest.mark.vllm
@pytest.mark.gate
def test_serve_transformers_saved_config(ckpts, evidence_root):
    def too_long(srv, rec):
        status, body = srv.request("/v1/completions", {"model": srv.model_name, "prompt": [5] * 300, "max_tokens": 1})
        rec.check("prompt longer than max_model_len is refused (HTTP 400)", status == 400, str(body)[:300])

    _greedy_gate(ckpts["tiny"], ckpts["tiny"], "serve_transformers_config", evidence_root, too_long)


@pytest.mark.vllm
@pytest.mark.gate
def test_serve_native_deepseek_layout(ckpts, evidence_root):
    # HCA rate 128 in the native config: a 150-token prompt reaches the first HCA entry (position 127)
    _greedy_gate(ckpts["native"], ckpts["hf128"], "serve_native_layout", evidence_root, lengths=(6, 40, 150))


HCA_RATE_NATIVE = 128
NATIVE_TOL = 1e-3  # float32 both sides, as the parity gate: rounding only, ~1e-6 measured there


@pytest.mark.vllm
@pytest.mark.gate
def test_native_layout_logits_through_hca_entries(ckpts, evidence_root):
    """The native layout (fused wqa_wkv, native names, DeepSeek's config keys) gives the transformers
    model's logits at every position, with prompts long enough that HCA (rate 128) has entries."""
    import json

    from _dsv4_cases import reference_fn

    from ascend_adapters.testing.parity import compare, vllm_logits

    cfg = json.loads((ckpts["native"] / "config.json").read_text())
    assert HCA_RATE_NATIVE in cfg["compress_ratios"]
    lengths = (40, 150, 200)  # the first HCA entry closes at position 127: two prompts attend to it
    rec = EvidenceRecord(model="deepseek_v4", gate="native_layout_logits_hca")
    ps = prompts(lengths, seed=22)
    rec.command("vllm.LLM(<native layout dir>, float32, max_model_len=256) greedy 8 tokens, raw logits; "
                "reference transformers DeepseekV4ForCausalLM (float32) on the transformers-saved twin")  # fmt: skip
    (res,) = vllm_logits(ckpts["native"], [ps], max_tokens=8, llm_kwargs={"max_model_len": 256})
    rep = compare(res, reference_fn(hf_model(ckpts["hf128"])))
    rec.metric("prompt_lengths", list(lengths))
    rec.metric("hca_rate", HCA_RATE_NATIVE)
    rec.metric("hca_entries_reached", [(n + 8 - 1) // HCA_RATE_NATIVE for n in lengths])
    rec.metric("max_abs_logit_diff", rep.max_abs_diff)
    rec.metric("per_sequence", rep.per_sequence)
    ok_l = rec.check(f"logits within {NATIVE_TOL} at every position", rep.max_abs_diff < NATIVE_TOL,
                     f"{rep.max_abs_diff:.3e}")  # fmt: skip
    ok_t = rec.check("greedy tokens identical", rep.tokens_identical, rep.first_divergence)
    rec.write(evidence_root)
    assert ok_l and ok_t, rep.as_dict()


def _with_extra_tensor(src, dst):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    t["layers.1.attn.wq_c.weight"] = torch.zeros(4, 4)
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _args(max_len="256", *extra):
    args = list(CPU_TEST_ARGS)
    args[args.index("--max-model-len") + 1] = max_len
    return args + list(extra)


@pytest.mark.vllm
@pytest.mark.gate
def test_startup_fails_closed_on_unmapped_native_tensor(ckpts, evidence_root):
    """The weights load in the worker: an unknown native tensor stops serving, named in the log."""
    model = _with_extra_tensor(ckpts["native"], ckpts["root"] / "native_extra")
    expect = "layers.1.attn.wq_c.weight"
    rec = EvidenceRecord(model="deepseek_v4", gate="bad_input_unmapped_native_tensor")
    srv = VllmServer(model, _args(), startup_timeout=400)
    rec.command(" ".join(srv.cmd))
    with pytest.raises(ServerStartError):
        srv.start()
        srv.stop()
    log = srv.log_text()
    rec.check("start-up refused naming the tensor", expect in log and "no skip rule drops it" in log, expect)
    rec.write(evidence_root)
    assert expect in log and "no skip rule drops it" in log, log[-3000:]


def _w8a8_export(ckpts, name, edit):
    import json

    from safetensors.torch import load_file, save_file

    from ascend_adapters.testing.modelslim import export_w8a8

    out = ckpts["root"] / name
    if out.exists():
        return out
    export_w8a8(ckpts["tiny"], out, {"*.attn.wq_b": "W8A8_DYNAMIC", "*.ffn.experts.*": "W8A8_DYNAMIC"})
    desc_path = out / "quant_model_description.json"
    desc = json.loads(desc_path.read_text())
    if edit == "unknown_type":
        desc["model.layers.0.attn.wq_b.weight"] = "W4A16_GROUPED"
        desc_path.write_text(json.dumps(desc))
    else:  # drop a companion from the weight files; the description still lists it
        (f,) = out.glob("quant_model_weights-*.safetensors")
        t = load_file(str(f))
        del t["model.layers.0.attn.wq_b.weight_scale"]
        save_file(t, str(f), metadata={"format": "pt"})
        idx_path = out / "quant_model_weights.safetensors.index.json"
        idx = json.loads(idx_path.read_text())
        idx["weight_map"].pop("model.layers.0.attn.wq_b.weight_scale", None)
        idx_path.write_text(json.dumps(idx))
    return out


@pytest.mark.vllm
@pytest.mark.gate
@pytest.mark.parametrize("case", ["window_only_beyond_window", "w8a8_unknown_quant_type", "w8a8_missing_companion"])
def test_startup_fails_closed_on_policy(ckpts, case, evidence_root, monkeypatch):
    """Refused while vLLM builds its config (real vllm.LLM start, in process, before any worker)."""
    from vllm import LLM

    kwargs = {
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 256,
        "kv_cache_memory_bytes": 64 << 20,
        "skip_tokenizer_init": True,
    }
    model = ckpts["tiny"]
    if case == "window_only_beyond_window":
        monkeypatch.setenv("ASCEND_ADAPTERS_DSV4_COMPRESSED", "0")
        kwargs["max_model_len"] = 64
        expect = "switched off (ASCEND_ADAPTERS_DSV4_COMPRESSED=0): 3 tokens (sliding window 16"
    elif case == "w8a8_unknown_quant_type":
        model = _w8a8_export(ckpts, "w8a8_unknown", "unknown_type")
        expect = "model.layers.0.attn.wq_b.weight' has unknown quantization type 'W4A16_GROUPED'"
    else:
        model = _w8a8_export(ckpts, "w8a8_missing", "missing_companion")
        expect = "model.layers.0.attn.wq_b.weight_scale: missing companion"
    rec = EvidenceRecord(model="deepseek_v4", gate=f"bad_input_{case}")
    rec.command(f"vllm.LLM({model}, {kwargs})")
    with pytest.raises(Exception) as info:
        LLM(model=str(model), **kwargs)
    msg = f"{type(info.value).__name__}: {info.value}"
    rec.check("start-up refused with the reason", expect in msg, msg[:500])
    rec.write(evidence_root)
    assert expect in msg, msg


FLASH_CONTEXT = 1048576
KV_BYTES = 768 << 20
CONCURRENT = 16
LONG_SHARES = (1024, 2047, 2100, 3000, 4100)  # of the 4200-token prompt, each then 40 tokens of its own


def _metric(srv, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"{srv.base_url}/metrics", timeout=30).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.vllm
@pytest.mark.gate
@pytest.mark.parametrize("cache", ["model_dtype", "fp8"])
def test_flash_layout_at_1m_context(tmp_path_factory, evidence_root, cache):
    """DeepSeek's published layout (native names and keys, Flash's yarn over 1M positions, hash layers,
    CSA 4 / HCA 128, MTP entries) served at max_model_len 1048576 with 768 MiB of KV cache: 16 short
    requests run at once (each holds pages for its own tokens, not for 1M), every greedy token equals
    transformers', and prompts sharing 1,024 to 4,100 tokens of a long one hit the prefix cache in whole
    128-token units (vLLM's hit counter per request). ``fp8``: the same with ``--kv-cache-dtype fp8`` in half
    the KV memory (384 MiB), the greedy tokens transformers' with its cache written 8-bit
    (``_dsv4_cases.kv8_reference_fn``)."""
    import threading
    import time

    hf_dir, native = make_native_hca128(tmp_path_factory.mktemp("dsv4flash"), long_context=True)
    model = hf_model(hf_dir)
    eight_bit = cache == "fp8"
    ref = kv8_reference_fn(model) if eight_bit else None
    short = prompts([5 + (135 * i) // (CONCURRENT - 1) for i in range(CONCURRENT)], seed=41)  # 5 .. 140 tokens
    # prefix hits are whole multiples of every cache's block span: 128 tokens (memory.hit_tokens)
    long_prompt, tail = prompts([4200, 40], seed=42)
    shared = [long_prompt[:n] + tail for n in LONG_SHARES]
    args = [
        "--dtype", "float32", "--enforce-eager", "--max-model-len", str(FLASH_CONTEXT),
        "--kv-cache-memory-bytes", str(KV_BYTES // 2 if eight_bit else KV_BYTES), "--max-num-seqs", str(CONCURRENT),
        "--enable-prefix-caching", "--max-num-batched-tokens", "4096",
    ] + (["--kv-cache-dtype", "fp8"] if eight_bit else [])  # fmt: skip
    rec = EvidenceRecord(model="deepseek_v4", gate="flash_layout_1m_context" + ("_kv8" if eight_bit else ""))
    with VllmServer(native, args=args, startup_timeout=900) as srv:
        rec.command(" ".join(srv.cmd))
        results, running = [None] * CONCURRENT, [0.0]
        done = threading.Event()

        def poll():
            while not done.is_set():
                running[0] = max(running[0], _metric(srv, "vllm:num_requests_running"))
                time.sleep(0.05)

        def ask(i):
            results[i] = _served_ids(srv, short[i])

        watcher = threading.Thread(target=poll)
        watcher.start()
        askers = [threading.Thread(target=ask, args=(i,)) for i in range(CONCURRENT)]
        for t in askers:
            t.start()
        for t in askers:
            t.join()
        done.set()
        watcher.join()
        long_runs, hits = [], []
        for p in [long_prompt, *shared]:  # one at a time: each request's hits are the counter's step
            before = _metric(srv, "vllm:prefix_cache_hits_total")
            long_runs.append(_served_ids(srv, p))
            hits.append(_metric(srv, "vllm:prefix_cache_hits_total") - before)
    want = [hf_greedy(model, p, N_TOKENS, ref) for p in short]
    want_long = [hf_greedy(model, p, N_TOKENS, ref) for p in (long_prompt, *shared)]
    expected_hits = [0] + [n // 128 * 128 for n in LONG_SHARES]
    rec.metric("prompt_lengths", [len(p) for p in short])
    rec.metric("max_requests_running", running[0])
    rec.metric("prefix_cache_hits", dict(zip(["first", *map(str, LONG_SHARES)], hits)))
    ok = [
        rec.check(f"{CONCURRENT} requests ran at once", running[0] == CONCURRENT, str(running[0])),
        rec.check("served greedy tokens == transformers greedy", results == want, str(results)),
        rec.check("long prompts: served greedy tokens == transformers greedy", long_runs == want_long),
        rec.check(
            f"prompts sharing {LONG_SHARES} tokens hit {expected_hits[1:]} (whole 128-token units)",
            hits == expected_hits,
            str(hits),
        ),
    ]
    rec.write(evidence_root)
    assert all(ok), rec.checks
