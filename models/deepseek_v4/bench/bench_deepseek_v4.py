"""DeepSeek-V4 on the portable path: W8A8 vs float32 serving, and vLLM vs transformers.

    python bench/bench_deepseek_v4.py --quick [--out results.json] [--evidence-dir evidence]

With --evidence-dir (or $ASCEND_ADAPTERS_EVIDENCE_DIR, set by `nox -s bench -- --evidence-dir
evidence`) the numbers and ratios go into an evidence record, deepseek_v4/bench-deepseek_v4.json,
with the load average at start and end and the versions.

Builds the tiny DeepSeek-V4 (``ascend_adapters.deepseek_v4.tiny``) and a ModelSlim W8A8_DYNAMIC
export of it (common's exporter), then, in the same run:

* vLLM (float32 activations) serving the float checkpoint and the W8A8 export: decode tokens/s at
  batch 1 and batch 8 (best of ``REPEAT`` runs on the same engine), and resident weight bytes of the
  loaded model;
* transformers' ``generate`` on the float checkpoint at batch 1, same prompt and length;
* the float checkpoint again on a compiled engine (vLLM's default, no ``--enforce-eager``): decode
  tokens/s compiled over eager at batch 1 and 8 (target: not slower) and both start-up times.

Prints ratios (W8A8 / float, vLLM / transformers). Each vLLM engine runs in its own process.

Then (unless ``--skip-vs-native``; ``--vs-native`` runs only this part) it serves DeepSeek's published layout (``tiny.write_release``: FP8 / FP4
weights, native config) twice in the same run: with this adapter, and with vLLM's own DeepSeek-V4
(plugins disabled, ``VLLM_PLUGINS=none``), both in bfloat16 (vLLM's own FP8 method refuses
float32), and reports the tokens/s ratio, or why vLLM's own model
cannot serve the checkpoint here (its error, one try).
On this CPU path both models run the portable kernels; the numbers say nothing about an NPU.

First (unless ``--skip-mtp``; ``--only-mtp`` runs only this part, record deepseek_v4/bench-deepseek_v4-mtp):
MTP speculative decoding. A tiny checkpoint whose MTP layer was fitted to its own model
(``testing.mtp_fit.make_deepseek_v4_mtp_fitted``) is served compiled with 2 MTP drafts and without: decode tokens/s at batch 1
and 8, greedy tokens compared, and the acceptance rate per draft position from vLLM's counters (target
in ``MTP_TARGETS``; ``test_deepseek_v4_mtp`` holds served acceptance to this record).
``--only-prefix`` (record deepseek_v4/bench-deepseek_v4-prefix): prefix caching on the Flash layout. The tiny
checkpoint with Flash's compression rates is served twice, prefix caching on then off, and 16 requests sharing a
300-token system prompt (then 40 tokens of their own) are sent one after another: cached tokens per request
(target: at least 256 after the first) and the median time to first token, off over on (target: at least 1.5x);
plus what 128-token hits cost on Flash's shape (``prefix_cost``, from memory.py).
The script exits non-zero when a check of a record it wrote failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ascend_adapters.common.evidence import BenchRun, add_evidence_dir_argument, refuse_busy_machine


def _prompt(n: int, seed: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 512, (n,), generator=g).tolist()


# Each batch is generated REPEAT times on the same engine and its best time kept: a batch-1 run of 128
# tokens lasts about a second here, and single runs moved the MTP / plain ratio between 0.91x and 1.37x.
REPEAT = 3


def worker(
    model_dir: str,
    prompt_len: int,
    gen: int,
    out: str,
    dtype: str = "float32",
    compiled: bool = False,
    mtp_drafts: int = 0,
) -> None:
    from vllm import LLM, SamplingParams

    from ascend_adapters.deepseek_v4.model import resident_weight_bytes
    from ascend_adapters.testing.engine_worker import counters, delta

    started = time.perf_counter()
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": mtp_drafts}} if mtp_drafts else {}
    llm = LLM(
        model=model_dir,
        dtype=dtype,
        enforce_eager=not compiled,
        max_model_len=prompt_len + gen + 8,
        kv_cache_memory_bytes=64 << 20,
        max_num_seqs=8,
        skip_tokenizer_init=True,
        disable_log_stats=False,
        **spec,
    )

    res = {"startup_s": time.perf_counter() - started, "weight_bytes": llm.apply_model(resident_weight_bytes)[0]}
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": _prompt(prompt_len, 0)}], params, use_tqdm=False)  # warm-up
    for batch in (1, 8):
        reqs = [{"prompt_token_ids": _prompt(prompt_len, i)} for i in range(batch)]
        before = counters(llm)
        times = []
        for _ in range(REPEAT):
            t = time.perf_counter()
            outs = llm.generate(reqs, params, use_tqdm=False)
            times.append(time.perf_counter() - t)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        res[f"tokens_per_s_batch{batch}"] = n / min(times)
        res[f"seconds_batch{batch}"] = times
        res[f"tokens_batch{batch}"] = n
        res[f"ids_batch{batch}"] = [list(o.outputs[0].token_ids) for o in outs]
        if mtp_drafts:
            res[f"spec_decode_counters_batch{batch}"] = delta(before, counters(llm))
    Path(out).write_text(json.dumps(res))


def run_engine(
    model_dir: Path,
    prompt_len: int,
    gen: int,
    extra_env: dict | None = None,
    dtype: str = "float32",
    compiled: bool = False,
    mtp_drafts: int = 0,
) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    # apply_model ships a function to the worker: allowed for this local, trusted benchmark process only
    env = {
        **os.environ,
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        **(extra_env or {}),
    }
    cmd = [sys.executable, __file__, "--worker", str(model_dir), str(prompt_len), str(gen), out, "--dtype", dtype]
    cmd += ["--compiled"] if compiled else []
    cmd += ["--mtp-drafts", str(mtp_drafts)] if mtp_drafts else []
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(
            f"engine for {model_dir} failed:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-600:])
        )
    res = json.loads(Path(out).read_text())
    os.unlink(out)
    return res


def hf_generate(model_dir: Path, prompt_len: int, gen: int) -> dict:
    import torch
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([_prompt(prompt_len, 0)])
    kw = {"max_new_tokens": gen, "min_new_tokens": gen, "do_sample": False}
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
        t = time.perf_counter()
        out = model.generate(ids, **kw)
        dt = time.perf_counter() - t
    return {"tokens_per_s_batch1": (out.shape[1] - ids.shape[1]) / dt, "tokens_batch1": out.shape[1] - ids.shape[1]}


def vs_native(prompt_len: int, gen: int) -> dict:
    from ascend_adapters.deepseek_v4.tiny import make_tiny, write_release

    with tempfile.TemporaryDirectory(prefix="bench-dsv4-native-") as tmp:
        hf = make_tiny(
            Path(tmp) / "hf", compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        )
        release = write_release(hf, Path(tmp) / "release")
        res = {
            "checkpoint": "tiny.write_release (DeepSeek's published layout)",
            "dtype": "bfloat16",
            "adapter": run_engine(release, prompt_len, gen, dtype="bfloat16"),
        }
        try:
            res["vllm_native"] = run_engine(release, prompt_len, gen, {"VLLM_PLUGINS": "none"}, dtype="bfloat16")
        except RuntimeError as exc:
            lines = [ln for ln in str(exc).splitlines() if ln.strip()]
            skip = ("errors.pydantic", "Engine core initialization failed", "Traceback", "Model Runner V2")
            errors = [
                ln.split("] ", 1)[-1]
                for ln in lines
                if ("Error:" in ln or " requires " in ln) and not any(k in ln for k in skip)
            ]
            res["vllm_native"] = {"served": False, "why": " ".join(e.strip() for e in (errors or lines[-1:]))[:800]}
    nat = res["vllm_native"]
    if "tokens_per_s_batch1" in nat:
        res["ratio_adapter_over_native_batch1"] = res["adapter"]["tokens_per_s_batch1"] / nat["tokens_per_s_batch1"]
    return res


# graph mode is what vLLM serves by default: compiled decode must not be slower than --enforce-eager
COMPILED_TARGET = 1.0


def _per_token_s(r: dict, batch: int) -> float:
    return 1.0 / r[f"tokens_per_s_batch{batch}"]


# Speculation is for latency-bound decode: at batch 1, decode with the fitted MTP drafter must not be
# slower than without it. Batch 8 is measured without a target: a step then verifies 8 x (1 + k) tokens,
# and on this CPU the tiny model's step time grows with its tokens.
MTP_TARGETS = {1: 1.0}
MTP_DRAFTS = 2  # as the served MTP gate (test_deepseek_v4_mtp.DRAFTS), so its floor reads both positions


def mtp_bench(run: BenchRun, prompt_len: int, gen: int) -> dict:
    """The MTP-fitted checkpoint (``testing.mtp_fit.make_deepseek_v4_mtp_fitted``) served compiled with and without MTP
    (``MTP_DRAFTS`` drafts), one engine after the other: decode tokens/s at batch 1 and 8, greedy tokens
    compared, acceptance per draft position from vLLM's counters (``test_deepseek_v4_mtp`` holds served
    acceptance to this record)."""
    from ascend_adapters.testing.mtp_fit import make_deepseek_v4_mtp_fitted as make_mtp_fitted

    with tempfile.TemporaryDirectory(prefix="bench-dsv4-mtp-") as tmp:
        ckpt, fit = make_mtp_fitted(Path(tmp) / "fitted")
        plain = run_engine(ckpt, prompt_len, gen, compiled=True)
        mtp = run_engine(ckpt, prompt_len, gen, compiled=True, mtp_drafts=MTP_DRAFTS)
    out = {
        "fit": fit,
        "drafts_per_step": MTP_DRAFTS,
        "startup_s": {"mtp": mtp["startup_s"], "plain": plain["startup_s"]},
    }
    drafts, per_pos = 0, [0] * MTP_DRAFTS
    for b in (1, 8):
        c = mtp.pop(f"spec_decode_counters_batch{b}")
        drafts += c["vllm:spec_decode_num_drafts"]
        per_pos = [x + y for x, y in zip(per_pos, c["vllm:spec_decode_num_accepted_tokens_per_pos"])]
        same = mtp.pop(f"ids_batch{b}") == plain.pop(f"ids_batch{b}")
        ratio = run.ratio(f"mtp_vs_plain_decode_batch{b}", _per_token_s(mtp, b), _per_token_s(plain, b),
                          "vLLM compiled without speculative decoding",
                          ours_tokens_per_s=round(mtp[f"tokens_per_s_batch{b}"], 2),
                          peer_tokens_per_s=round(plain[f"tokens_per_s_batch{b}"], 2))  # fmt: skip
        out[f"batch{b}"] = {"spec_decode_counters": c, "same_tokens": same, "ratio_mtp_over_plain": ratio}
        run.check(f"MTP batch {b}: greedy tokens identical to decoding without MTP", same)
        run.check(f"MTP batch {b}: generated {b} x {gen} tokens", mtp[f"tokens_batch{b}"] == b * gen,
                  mtp[f"tokens_batch{b}"])  # fmt: skip
        if b in MTP_TARGETS:
            run.check(f"MTP batch {b}: decode tokens/s with MTP over without >= {MTP_TARGETS[b]}",
                      ratio >= MTP_TARGETS[b], round(ratio, 3))  # fmt: skip
        print(f"  MTP batch {b}: {mtp[f'tokens_per_s_batch{b}']:8.1f} tok/s, plain "
              f"{plain[f'tokens_per_s_batch{b}']:8.1f} tok/s, ratio {ratio:5.2f}x, same tokens: {same}")  # fmt: skip
    out["drafts"] = drafts
    out["acceptance_per_position"] = [n / drafts for n in per_pos]
    out["mean_accepted_length"] = 1 + sum(per_pos) / drafts
    run.check("MTP drafts proposed", drafts > 0, drafts)
    print(f"  MTP acceptance per position {out['acceptance_per_position']}, fit {fit}")
    return out


# -- memory: what vLLM holds per request ------------------------------------------------------------
MEMORY_CONTEXT = 16384  # max_model_len of the memory part
MEMORY_LENGTHS = (100, 1000, 4000, 12000)
MEMORY_KV_BYTES = 256 << 20
MEMORY_CHUNK = 1024


def memory_worker(model_dir: str, out: str, kv_cache_dtype: str = "auto") -> None:
    """One in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the scheduler's block pool is readable
    here); per length a request alone, its prompt in chunks of ``MEMORY_CHUNK`` tokens: the blocks in use
    after every step (vLLM frees the blocks behind the sliding windows when it schedules a step)."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=MEMORY_CONTEXT,
        max_num_batched_tokens=MEMORY_CHUNK,
        enable_chunked_prefill=True,
        kv_cache_memory_bytes=MEMORY_KV_BYTES,
        max_num_seqs=1,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    config = scheduler.kv_cache_config
    pool = scheduler.kv_cache_manager.block_pool
    # the groups overlay one allocation (a block id belongs to one group at a time). vLLM 0.32 packs every
    # group's pages into each block id (block-outermost layout): a tensor is a view at its offset inside the
    # block, the allocation num_blocks x block_stride; elsewhere it is the end of the furthest tensor
    strides = {getattr(t, "block_stride", None) for t in config.kv_cache_tensors}
    if len(strides) == 1 and None not in strides:
        allocated = config.num_blocks * strides.pop()
    else:
        allocated = max(t.offset + t.size for t in config.kv_cache_tensors)
    res = {
        "kv_cache_memory_bytes": MEMORY_KV_BYTES,
        "allocated_bytes": allocated,
        "num_blocks": config.num_blocks,
        "groups": [
            {
                "layers": len(g.layer_names),
                "spec": type(g.kv_cache_spec).__name__,
                "block_size": g.kv_cache_spec.block_size,
            }
            for g in config.kv_cache_groups
        ],
        "num_tensors": len(config.kv_cache_tensors),
        "lengths": {},
    }
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    for n in MEMORY_LENGTHS:
        engine.add_request(f"len{n}", {"prompt_token_ids": _prompt(n, n)}, params)
        used = []
        while engine.has_unfinished_requests():
            engine.step()
            used.append(pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())  # block 0 is the null block
        res["lengths"][str(n)] = {"blocks_after_each_step": used, "bytes_per_block": allocated // config.num_blocks}
    Path(out).write_text(json.dumps(res))


def old_fixed_page_bytes(config, max_model_len: int) -> int:
    """The fixed float32 page every layer held per request before the caches were paged (stop 34's
    ``memory.state_shapes``): window ``W x head_dim``, input ring ``max(2 x csa, hca) x hidden``, and
    ``max_model_len / min rate + 1`` entries of ``head_dim + index_head_dim``."""
    rates = config.compress_rates.values()
    per_layer = (
        config.sliding_window * config.head_dim
        + max(2 * min(rates), max(rates)) * config.hidden_size
        + (max_model_len // min(rates) + 1) * (config.head_dim + config.index_head_dim)
    )
    return per_layer * 4 * config.num_hidden_layers


def memory_bench(run: BenchRun, kv_cache_dtype: str = "auto") -> dict:
    """The tiny served alone at MEMORY_LENGTHS: the bytes vLLM holds per request against
    ``memory.request_cache_bytes`` (``kv_cache_dtype``: "auto", or an 8-bit cache dtype: "fp8",
    "int8_per_token_head"; the checks name it)."""
    from ascend_adapters.deepseek_v4.memory import request_cache_bytes
    from ascend_adapters.deepseek_v4.tiny import TINY_CONFIG, make_tiny, tiny_config

    cfg = tiny_config()
    with tempfile.TemporaryDirectory(prefix="bench-dsv4-memory-") as tmp:
        # the tiny checkpoint with its yarn set stretched to MEMORY_CONTEXT positions
        yarn = TINY_CONFIG["rope_parameters"]
        rope = {**yarn, "factor": MEMORY_CONTEXT / yarn["original_max_position_embeddings"]}
        model_dir = make_tiny(Path(tmp) / "tiny", rope_parameters=rope, max_position_embeddings=MEMORY_CONTEXT)
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        proc = subprocess.run(
            [sys.executable, __file__, "--memory-worker", str(model_dir), out, kv_cache_dtype],
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if proc.returncode != 0:
            raise RuntimeError("memory engine failed:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-300:]))
        res = json.loads(Path(out).read_text())
        os.unlink(out)
    run.check(
        "the KV cache vLLM allocated fits the memory given",
        res["allocated_bytes"] <= res["kv_cache_memory_bytes"],
        res["allocated_bytes"],
    )
    old = old_fixed_page_bytes(cfg, MEMORY_CONTEXT)
    named = "" if kv_cache_dtype == "auto" else f", --kv-cache-dtype {kv_cache_dtype}"
    held = []
    for n in MEMORY_LENGTHS:
        r = res["lengths"][str(n)]
        # the step before the last: the request has its prompt and 2 generated tokens in the cache (the
        # last step finishes it and frees its blocks)
        after_decode = r["blocks_after_each_step"][-2] * r["bytes_per_block"]
        formula = request_cache_bytes(cfg, n + 2, dtype_bytes=4, eight_bit=kv_cache_dtype != "auto")
        r.update(held_bytes=after_decode, formula_bytes=formula, old_fixed_page_bytes=old)
        held.append(after_decode)
        # memory.request_cache_bytes counts the blocks vLLM's managers hold (full caches: every block up to
        # the request's tokens; sliding caches: at most a window's blocks) at one page each
        run.check(f"{n} tokens{named}: vLLM holds the formula's pages", after_decode == formula,
                  f"{after_decode} vs {formula}")  # fmt: skip
        r["held_over_formula"] = round(after_decode / formula, 3)
        r["held_over_old_page"] = round(after_decode / old, 4)
    run.check(
        f"what a request holds grows with its own tokens{named}", held == sorted(held) and held[0] < held[-1], held
    )
    if kv_cache_dtype != "auto":
        return res
    run.check(
        f"a {MEMORY_LENGTHS[0]}-token request holds less than a tenth of the old fixed page at max_model_len "
        f"{MEMORY_CONTEXT}",
        held[0] * 10 < old,
        f"{held[0]} vs {old}",
    )
    return res


# 8-bit over bfloat16 KV-cache bytes per request (issue #50)
KV8_TARGET = 0.55
KV8_FLASH_LENGTHS = (4096, 131072, 1 << 20)


def kv8_bench(run: BenchRun, float32: dict) -> dict:
    """The 8-bit caches (record bench-deepseek_v4-kv8): the tiny served again at MEMORY_LENGTHS with
    ``--kv-cache-dtype fp8``, vLLM's held bytes against ``memory.request_cache_bytes(eight_bit=True)`` and
    against the float32 run (``float32``: ``memory_bench``'s result), and with ``int8_per_token_head`` (the same
    bytes a row: held against the same formula); then DeepSeek-V4-Flash's bytes per request (the same
    arithmetic) at KV8_FLASH_LENGTHS, bfloat16 against 8-bit, target KV8_TARGET. The compressors' states are not
    stored 8-bit (CSA rows in the model dtype, HCA summaries float32: pooled through a softmax of their gates),
    so a short request, whose states weigh most, saves a little less."""
    from ascend_adapters.deepseek_v4.memory import flash_config, request_cache_bytes

    res = memory_bench(run, "fp8")
    res["int8_per_token_head"] = memory_bench(run, "int8_per_token_head")["lengths"]
    for n in MEMORY_LENGTHS:
        r, f = res["lengths"][str(n)], float32["lengths"][str(n)]
        r["held_over_float32"] = round(r["held_bytes"] / f["held_bytes"], 4)
    cfg = flash_config()
    flash = {}
    for n in KV8_FLASH_LENGTHS:
        bf16, eight = request_cache_bytes(cfg, n, 2), request_cache_bytes(cfg, n, 2, eight_bit=True)
        flash[f"{n}_tokens"] = {"bfloat16_bytes": bf16, "fp8_bytes": eight, "ratio": round(eight / bf16, 4)}
        run.target(
            f"Flash, {n} tokens: 8-bit over bfloat16 bytes per request",
            round(eight / bf16, 4),
            KV8_TARGET,
            "half the cache memory at long context (issue #50)",
            at_most=True,
        )
    res["flash"] = flash
    return res


# --- prefix caching on the Flash layout (--only-prefix, record bench-deepseek_v4-prefix) --------------------------
FLASH_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
PREFIX_SYSTEM, PREFIX_OWN, PREFIX_REQUESTS = 300, 40, 16
PREFIX_MIN_CACHED = 256  # the whole 128-token units of the 300-token system prompt
PREFIX_TTFT_TARGET = 1.5


def _hits(srv) -> float:
    import urllib.request

    from ascend_adapters.testing.soak import prometheus_totals

    text = urllib.request.urlopen(f"{srv.base_url}/metrics", timeout=30).read().decode()
    return prometheus_totals(text).get("vllm:prefix_cache_hits_total", 0.0)


def prefix_requests(model_dir: Path, caching: bool) -> dict:
    """One ``vllm serve`` of the Flash-layout tiny, prefix caching on or off: two warm-up prompts, then
    PREFIX_REQUESTS prompts one after another, each the shared system prompt and tokens of its own, each a
    1-token completion (its latency: the time to its first token plus the response). Per request the
    latency and the tokens vLLM's hit counter adds."""
    from ascend_adapters.common.server import VllmServer

    system = _prompt(PREFIX_SYSTEM, 61)
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    # compiled, as served by default
    args = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-bytes", "256M", "--max-num-seqs", "4"]
    out = {"latency_s": [], "cached_tokens": []}
    with VllmServer(model_dir, args=[*args, flag], startup_timeout=900) as srv:
        out["command"] = " ".join(srv.cmd)
        for i in range(2):
            srv.complete(_prompt(PREFIX_SYSTEM + PREFIX_OWN, 70 + i), max_tokens=1)
        for i in range(PREFIX_REQUESTS):
            before = _hits(srv)
            t0 = time.perf_counter()
            srv.complete(system + _prompt(PREFIX_OWN, 100 + i), max_tokens=1)
            out["latency_s"].append(time.perf_counter() - t0)
            out["cached_tokens"].append(_hits(srv) - before)
    return out


def prefix_cost() -> dict:
    """What 128-token hits cost on DeepSeek-V4-Flash (bf16), from memory.py's model of vLLM's grouping
    (``test_deepseek_v4_memory`` holds it to vLLM's own): per request, the bytes and block ids held (a block
    id spans every group's pages, 860 KiB), against the previous layout's bytes and pages (every cache one 128 KiB page, 16 rows of the hidden
    size; the HCA entries' block 16384 tokens, restated from that design's memory.py)."""
    import math

    from ascend_adapters.deepseek_v4 import memory as M

    cfg = M.flash_config()
    groups, slab = M.cache_groups(cfg, cfg.layer_types, 2)
    page = 16 * math.lcm(cfg.hidden_size, cfg.head_dim, cfg.index_head_dim)
    old = []  # (block_size, sliding_window) of every cache of every layer, all pages `page` values
    for t in cfg.layer_types:
        hd, old_rows = cfg.head_dim, lambda w: page // w
        old.append((old_rows(hd), cfg.sliding_window))
        if t == M.LAYER_SLIDING:
            continue
        rate, csa = cfg.compress_rates[t], t == M.LAYER_CSA
        width = M.state_width(hd, csa)
        old += [(old_rows(width), (2 if csa else 1) * rate), (rate * old_rows(hd), None)]
        if csa:
            iw = M.state_width(cfg.index_head_dim, True)
            old += [(old_rows(iw), 2 * rate), (rate * old_rows(cfg.index_head_dim), None)]
    old_geo = [M.CacheGeometry(1, 1, b, w) for b, w in old]
    # vLLM's admission reservation per request (window + one scheduler step of 8192 tokens for a sliding
    # cache): each block a sliding group reserves costs a whole block id, so the reservation grows
    reserved = {}
    for n in (131072, 1048576):
        reserved[str(n)] = {
            "bytes": slab * sum(M.reserved_blocks(g.geometry, n, 8192) for g in groups),
            "previous_bytes": page * 2 * sum(M.reserved_blocks(g, n, 8192) for g in old_geo),
        }
    rows = []
    for n in (100, 4096, 131072, 1048576):
        new_blocks = sum(g.geometry.blocks(n) for g in groups)
        old_blocks = sum(g.blocks(n) for g in old_geo)
        rows.append(
            {
                "tokens": n,
                "bytes": M.request_cache_bytes(cfg, n),
                "previous_bytes": old_blocks * page * 2,
                "block_ids": new_blocks,
                "previous_pages": old_blocks,
            }
        )
    return {
        "hit_tokens": M.hit_tokens(cfg),
        "previous_hit_tokens": math.lcm(*(g.block_size for g in old_geo)),
        "block_id_bytes": slab,
        "groups": [{"block_size": g.geometry.block_size, "layers": g.layers} for g in groups],
        "per_request": rows,
        "reserved_per_request_max_num_batched_tokens_8192": reserved,
    }


def prefix_bench(run: BenchRun) -> dict:
    import statistics

    from ascend_adapters.deepseek_v4.tiny import make_tiny

    with tempfile.TemporaryDirectory(prefix="bench-dsv4-prefix-") as tmp:
        model_dir = make_tiny(Path(tmp) / "flash", seed=5, compress_rates=FLASH_RATES)
        on = prefix_requests(model_dir, caching=True)
        off = prefix_requests(model_dir, caching=False)
    later = on["cached_tokens"][1:]
    run.target(
        "fewest cached tokens of a request after the first",
        min(later),
        PREFIX_MIN_CACHED,
        f"the {PREFIX_SYSTEM}-token system prompt's whole 128-token units",
    )
    run.check("prefix caching off: no request hits", sum(off["cached_tokens"]) == 0, off["cached_tokens"])
    # the first request computes the system prompt in both runs: compare the 15 after it
    on_s, off_s = statistics.median(on["latency_s"][1:]), statistics.median(off["latency_s"][1:])
    ratio = run.ratio("ttft_prefix_caching_over_off", on_s, off_s, "the same server with prefix caching off")
    run.target(
        "time to first token, median of the requests after the first, caching off over on",
        round(ratio, 3),
        PREFIX_TTFT_TARGET,
        "issue 51's target",
    )
    cost = prefix_cost()
    run.target(
        "DeepSeek-V4-Flash prefix-hit granularity (tokens)",
        cost["hit_tokens"],
        128,
        "a hit at every 128 tokens",
        at_most=True,
    )
    return {"prefix_caching_on": on, "prefix_caching_off": off, "flash_cost": cost}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short prompt and generation (CI smoke)")
    ap.add_argument("--out", help="write the numbers as JSON here")
    ap.add_argument("--vs-native", action="store_true", help="only this adapter vs vLLM's own DeepSeek-V4")
    ap.add_argument("--skip-vs-native", action="store_true", help="leave out the comparison with vLLM's own model")
    ap.add_argument(
        "--only-mtp", action="store_true", help="only MTP speculative decoding (record bench-deepseek_v4-mtp)"
    )
    ap.add_argument("--skip-mtp", action="store_true", help="leave out MTP speculative decoding")
    ap.add_argument(
        "--only-memory", action="store_true", help="only the bytes vLLM holds per request (bench-deepseek_v4-memory)"
    )
    ap.add_argument(
        "--only-prefix",
        action="store_true",
        help="only prefix caching on the Flash layout: cached tokens and TTFT, on against off (bench-deepseek_v4-prefix)",
    )
    ap.add_argument("--memory-worker", nargs=3, help=argparse.SUPPRESS)
    add_evidence_dir_argument(ap)
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mtp-drafts", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_worker:
        memory_worker(*args.memory_worker)
        return 0
    if args.worker:
        model_dir, prompt_len, gen, out = args.worker
        worker(model_dir, int(prompt_len), int(gen), out, args.dtype, args.compiled, args.mtp_drafts)
        return 0
    # after the worker modes: a worker runs while its own bench loads the machine
    refuse_busy_machine(args)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ascend_adapters.common.versions import engine_distribution
    from ascend_adapters.deepseek_v4.tiny import make_tiny
    from ascend_adapters.testing.modelslim import DEEPSEEK_V4_W8A8_PLAN as W8A8_PLAN
    from ascend_adapters.testing.modelslim import export_w8a8

    failed = 0
    if args.only_memory:
        mem_run = BenchRun("deepseek_v4", "deepseek_v4-memory")
        mem_run.metric("memory", memory_bench(mem_run))
        mem_run.metric("max_model_len", MEMORY_CONTEXT)
        mem_run.write(args.evidence_dir)
        print(json.dumps(mem_run.rec.checks, indent=2))
        kv8_run = BenchRun("deepseek_v4", "deepseek_v4-kv8")
        kv8_run.metric("kv8", kv8_bench(kv8_run, mem_run.rec.metrics["memory"]))
        kv8_run.write(args.evidence_dir)
        print(json.dumps(kv8_run.rec.checks, indent=2))
        return int(not (mem_run.rec.passed and kv8_run.rec.passed))
    if args.only_prefix:
        prefix_run = BenchRun("deepseek_v4", "deepseek_v4-prefix")
        prefix_run.metric("prefix", prefix_bench(prefix_run))
        prefix_run.rec.notes.append("the two servers ran one after another in this run, each in its own process")
        prefix_run.write(args.evidence_dir)
        print(json.dumps(prefix_run.rec.checks, indent=2))
        return int(not prefix_run.rec.passed)
    if not args.skip_mtp and not args.vs_native:
        mtp_run = BenchRun("deepseek_v4", "deepseek_v4-mtp")
        mtp_len, mtp_gen = (24, 48) if args.quick else (100, 128)
        mtp_run.metric("mtp", mtp_bench(mtp_run, mtp_len, mtp_gen))
        mtp_run.metric("prompt_len", mtp_len)
        mtp_run.metric("generated", mtp_gen)
        mtp_run.rec.notes.append("the two engines ran one after another in this run, each in its own process")
        mtp_run.write(args.evidence_dir)
        failed |= not mtp_run.rec.passed
    if args.only_mtp:
        return int(failed)
    prompt_len, gen = (24, 16) if args.quick else (100, 64)
    run = BenchRun("deepseek_v4", "deepseek_v4-vs-native" if args.vs_native else "deepseek_v4")
    results = {
        "engine": " ".join(engine_distribution() or ("?",)),
        "quick": args.quick,
        "prompt_len": prompt_len,
        "generated": gen,
    }
    if not args.vs_native:
        with tempfile.TemporaryDirectory(prefix="bench-dsv4-") as tmp:
            float_dir = make_tiny(Path(tmp) / "float")
            w8a8_dir = export_w8a8(float_dir, Path(tmp) / "w8a8", W8A8_PLAN)
            results.update(
                shape="ascend_adapters.deepseek_v4.tiny.TINY_CONFIG",
                vllm_float32=run_engine(float_dir, prompt_len, gen),
                vllm_float32_compiled=run_engine(float_dir, prompt_len, gen, compiled=True),
                vllm_w8a8_dynamic=run_engine(w8a8_dir, prompt_len, gen),
                transformers_generate_float32=hf_generate(float_dir, prompt_len, gen),
            )
        f, q, hf = results["vllm_float32"], results["vllm_w8a8_dynamic"], results["transformers_generate_float32"]
        results["ratios"] = {
            "w8a8_over_float_tokens_per_s_batch1": q["tokens_per_s_batch1"] / f["tokens_per_s_batch1"],
            "w8a8_over_float_tokens_per_s_batch8": q["tokens_per_s_batch8"] / f["tokens_per_s_batch8"],
            "w8a8_over_float_weight_bytes": q["weight_bytes"] / f["weight_bytes"],
            "vllm_over_transformers_tokens_per_s_batch1": f["tokens_per_s_batch1"] / hf["tokens_per_s_batch1"],
        }
        for name, r in (("vLLM float32", f), ("vLLM W8A8_DYNAMIC", q)):
            print(
                f"{name:20s} batch1 {r['tokens_per_s_batch1']:8.1f} tok/s  batch8 {r['tokens_per_s_batch8']:8.1f} "
                f"tok/s  weights {r['weight_bytes'] / 1e6:6.2f} MB"
            )
        print(f"{'transformers float32':20s} batch1 {hf['tokens_per_s_batch1']:8.1f} tok/s")
        for k, v in results["ratios"].items():
            print(f"{k}: {v:.3f}")
        # ratio = peer seconds per token / ours: > 1 means the first-named path is faster
        for b in (1, 8):
            run.ratio(f"w8a8_vs_float_decode_batch{b}", _per_token_s(q, b), _per_token_s(f, b), "vLLM float32",
                      ours_tokens_per_s=round(q[f"tokens_per_s_batch{b}"], 2),
                      peer_tokens_per_s=round(f[f"tokens_per_s_batch{b}"], 2))  # fmt: skip
        run.ratio("vllm_vs_transformers_decode_batch1", _per_token_s(f, 1), _per_token_s(hf, 1),
                  "transformers generate (float32)", ours_tokens_per_s=round(f["tokens_per_s_batch1"], 2),
                  peer_tokens_per_s=round(hf["tokens_per_s_batch1"], 2))  # fmt: skip
        run.metric("w8a8_over_float_weight_bytes", round(results["ratios"]["w8a8_over_float_weight_bytes"], 3))
        # graph mode, vLLM's default: compiled decode must not be slower than --enforce-eager
        c = results["vllm_float32_compiled"]
        for b in (1, 8):
            ratio = run.ratio(f"compiled_vs_eager_decode_batch{b}", _per_token_s(c, b), _per_token_s(f, b),
                              "vLLM float32 --enforce-eager", ours_tokens_per_s=round(c[f"tokens_per_s_batch{b}"], 2),
                              peer_tokens_per_s=round(f[f"tokens_per_s_batch{b}"], 2))  # fmt: skip
            run.check(f"compiled decode at batch {b} not slower than eager (ratio >= {COMPILED_TARGET})",
                      ratio >= COMPILED_TARGET, round(ratio, 3))  # fmt: skip
        run.metric("startup_s", {"compiled": round(c["startup_s"], 1), "eager": round(f["startup_s"], 1)})
        print(f"compiled vs eager: start-up {c['startup_s']:.1f} s vs {f['startup_s']:.1f} s")
    if args.vs_native or not args.skip_vs_native:
        nat = results["vs_native"] = vs_native(prompt_len, gen)
        print(json.dumps(nat, indent=2))
        native = nat["vllm_native"]
        if "tokens_per_s_batch1" in native:
            run.ratio("adapter_vs_vllm_native_decode_batch1", _per_token_s(nat["adapter"], 1),
                      _per_token_s(native, 1), "vLLM's own DeepSeek-V4 (VLLM_PLUGINS=none, bfloat16)")  # fmt: skip
        else:
            run.rec.skip("adapter vs vLLM's own DeepSeek-V4 ratio", native["why"])
    # a rate is only meaningful over the full requested length (ignore_eos / min_new_tokens)
    engines = {
        k: results[k]
        for k in ("vllm_float32", "vllm_float32_compiled", "vllm_w8a8_dynamic", "transformers_generate_float32")
        if k in results
    }
    engines.update(
        {f"vs_native {k}": v for k, v in results.get("vs_native", {}).items() if k in ("adapter", "vllm_native")}
    )
    for name, r in engines.items():
        for b in (1, 8):
            r.pop(f"ids_batch{b}", None)
            if f"tokens_batch{b}" in r:
                run.check(f"{name}: batch {b} generated {b} x {gen} tokens", r[f"tokens_batch{b}"] == b * gen,
                          r[f"tokens_batch{b}"])  # fmt: skip
    run.metric("results", results)
    run.rec.notes.append("the engines ran one after another in this run, each in its own process (not interleaved)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    run.write(args.evidence_dir)
    return int(failed or not run.rec.passed)


if __name__ == "__main__":
    sys.exit(main())
