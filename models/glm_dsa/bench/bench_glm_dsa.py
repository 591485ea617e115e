"""GLM-DSA benchmark (CPU): vLLM vs transformers generate, and the sparse path's cost against dense.

    python bench/bench_glm_dsa.py --quick          # CI smoke (tiny model, few tokens)
    python bench/bench_glm_dsa.py --out r.json     # full run

Measured in the same run:
1. decode throughput (tokens/s) of the tiny checkpoint through vLLM and through
   transformers' ``generate`` (greedy, KV cache), batch 1 and 8, ratio vLLM/transformers;
2. the portable sparse path against the dense path at context = index_topk
   (same model, exact same math), and as the context grows to 2x and 4x
   index_topk (the dense numbers there come from the same weights served with a
   larger index_topk: a cost peer, not the same model).

Each vLLM engine runs in its own subprocess. Numbers are wall-clock on a shared
CPU machine: read the ratios, not the absolute values.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 500, (length,), generator=g).tolist() for _ in range(n)]


def worker(spec_path: str) -> int:
    """Inside a subprocess: one engine, a list of timed jobs."""
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,
        max_num_seqs=8,
        **spec["llm_kwargs"],
    )
    results = []
    for job in spec["jobs"]:
        params = SamplingParams(temperature=0.0, max_tokens=job["gen"], ignore_eos=True, detokenize=False)
        prompts = [{"prompt_token_ids": p} for p in _prompts(job["batch"], job["prompt_len"], job["seed"])]
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False), use_tqdm=False)
        best = float("inf")
        for _ in range(job.get("repeat", 2)):
            t0 = time.perf_counter()
            out = llm.generate(prompts, params, use_tqdm=False)
            best = min(best, time.perf_counter() - t0)
        ntok = sum(len(o.outputs[0].token_ids) for o in out)
        results.append({**job, "seconds": best, "generated_tokens": ntok, "tokens_per_s": ntok / best})
    Path(spec["out"]).write_text(json.dumps(results))
    return 0


def run_engine(model: Path, llm_kwargs: dict, jobs: list[dict], env: dict | None = None) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bench-glm-dsa-") as tmp:
        spec = {"model": str(model), "llm_kwargs": llm_kwargs, "jobs": jobs, "out": str(Path(tmp) / "out.json")}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", str(Path(tmp) / "spec.json")],
            env={**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **(env or {})},
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if proc.returncode != 0:
            raise RuntimeError("bench engine failed:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-40:]))
        return json.loads(Path(spec["out"]).read_text())


def transformers_generate(model_dir: Path, batch: int, prompt_len: int, gen: int, seed: int, repeat: int = 2) -> dict:
    import torch
    from transformers import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor(_prompts(batch, prompt_len, seed))
    best = float("inf")
    with torch.no_grad():
        model.generate(ids[:1], max_new_tokens=2, do_sample=False)
        for _ in range(repeat):
            t0 = time.perf_counter()
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen, min_new_tokens=gen, do_sample=False
            )
            best = min(best, time.perf_counter() - t0)
    ntok = int((out.shape[1] - prompt_len) * batch)
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "gen": gen,
        "seconds": best,
        "generated_tokens": ntok,
        "tokens_per_s": ntok / best,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI smoke: fewer tokens and contexts")
    ap.add_argument("--out", help="write the numbers as JSON here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from ascend_adapters.glm_dsa.tiny import make_tiny

    topk = 16 if args.quick else 64
    gen = 8 if args.quick else 32
    prompt_len = 16
    ctx_mults = [1, 4] if args.quick else [1, 2, 4]
    tmp = Path(tempfile.mkdtemp(prefix="bench-glm-dsa-"))
    try:
        sparse_ckpt = make_tiny(tmp / "sparse", index_topk=topk, tokenizer=False)
        dense_ckpt = make_tiny(tmp / "dense", index_topk=4 * topk + gen, tokenizer=False)
        mml = 4 * topk + gen  # > index_topk: the sparse checkpoint gets the sparse path, the dense one (4x) not
        ctx_gen = 4

        # throughput + sparse scaling: one engine, sparse path chosen automatically (max_model_len > index_topk)
        jobs = [
            {"name": f"throughput_b{b}", "batch": b, "prompt_len": prompt_len, "gen": gen, "seed": 3} for b in (1, 8)
        ]
        jobs += [
            {"name": f"context_{m}x", "batch": 1, "prompt_len": m * topk - ctx_gen, "gen": ctx_gen, "seed": 4}
            for m in ctx_mults
        ]
        sparse_res = {r["name"]: r for r in run_engine(sparse_ckpt, {"max_model_len": mml}, jobs)}
        # dense peer: same weights with index_topk = 4x, so max_model_len <= index_topk and the dense path is
        # chosen; at context <= the original index_topk both engines compute exactly the same model
        ctx_jobs = [j for j in jobs if j["name"].startswith("context_")]
        dense_res = {r["name"]: r for r in run_engine(dense_ckpt, {"max_model_len": mml}, ctx_jobs)}

        hf = {b: transformers_generate(sparse_ckpt, b, prompt_len, gen, seed=3) for b in (1, 8)}
        report = {
            "index_topk": topk,
            "gen_tokens": gen,
            "prompt_len": prompt_len,
            "quick": args.quick,
            "throughput": {},
            "sparse_vs_dense": {},
        }
        print(f"GLM-DSA tiny (index_topk={topk}), float32, CPU; greedy, {gen} new tokens, prompt {prompt_len}")
        for b in (1, 8):
            v, h = sparse_res[f"throughput_b{b}"]["tokens_per_s"], hf[b]["tokens_per_s"]
            report["throughput"][f"batch{b}"] = {"vllm_tok_s": v, "transformers_tok_s": h, "ratio": v / h}
            print(f"  batch {b}: vLLM {v:8.1f} tok/s   transformers {h:8.1f} tok/s   ratio {v / h:5.2f}x")
        same = sparse_res["context_1x"]["seconds"] / dense_res["context_1x"]["seconds"]
        print(f"  context = index_topk ({topk}): sparse path / dense path = {same:5.2f}x (same weights, same math)")
        base = sparse_res["context_1x"]["seconds"]
        for m in ctx_mults:
            s, d = sparse_res[f"context_{m}x"]["seconds"], dense_res[f"context_{m}x"]["seconds"]
            report["sparse_vs_dense"][f"context_{m}x"] = {
                "context": m * topk,
                "sparse_s": s,
                "dense_s": d,
                "sparse_over_dense": s / d,
                "sparse_scaling_vs_1x": s / base,
            }
            print(
                f"  context {m}x ({m * topk:4d} tok): sparse {s * 1e3:8.1f} ms  dense {d * 1e3:8.1f} ms  "
                f"ratio {s / d:5.2f}x  sparse scaling vs 1x {s / base:5.2f}x"
            )
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
