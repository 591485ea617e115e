"""Prompt batches one after another on one vLLM engine, in a subprocess: per request the generated
tokens and their raw logits, per batch vLLM's own counters (``engine_run``).

``python -m ascend_adapters.testing.engine_worker SPEC_JSON OUT_PT``; the spec holds ``model``, ``runs``
(a list of batches of token-id prompts), ``max_tokens`` (one for all batches, or one per batch) and
``llm_kwargs``. No prompt
logprobs are asked for: vLLM does not read the prefix cache for requests that want them.
Before and after each batch the engine's counters are read (``LLM.get_metrics``): prefix-cache
hits and queries, preemptions, and the speculative decoding counters (drafts, draft tokens, accepted tokens,
accepted tokens per draft position).
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

COUNTERS = (
    "vllm:prefix_cache_hits",
    "vllm:prefix_cache_queries",
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:num_preemptions",
)
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def counters(llm) -> dict:
    """vLLM's prefix-cache, preemption and speculative-decoding counters of ``llm`` now (summed over engines)."""
    out = {}
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[m.name] = out.get(m.name, 0) + int(m.value)
        elif m.name == PER_POSITION:
            old = out.get(m.name, [0] * len(m.values))
            out[m.name] = [a + int(b) for a, b in zip(old, m.values)]
    return out


def delta(before: dict, after: dict) -> dict:
    """``after - before`` per counter (per draft position for the per-position counter)."""
    out = {}
    for name, value in after.items():
        if isinstance(value, list):
            out[name] = [a - b for a, b in zip(value, before.get(name, [0] * len(value)))]
        else:
            out[name] = value - before.get(name, 0)
    return out


def main(spec_path, out_path):
    import torch
    from vllm import LLM, SamplingParams

    spec = json.loads(open(spec_path).read())
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        logprobs_mode="raw_logits",
        max_logprobs=-1,
        disable_log_stats=False,
        **spec["llm_kwargs"],
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()
    limits = spec["max_tokens"]
    if isinstance(limits, int):
        limits = [limits] * len(spec["runs"])
    out = []
    for batch, limit in zip(spec["runs"], limits, strict=True):
        params = SamplingParams(temperature=0.0, max_tokens=limit, logprobs=-1, detokenize=False, ignore_eos=True)
        before = counters(llm)
        results = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        after = counters(llm)
        rows = []
        for prompt, res in zip(batch, results):
            comp = res.outputs[0]
            logits = torch.full((len(comp.logprobs), vocab), float("nan"))
            for j, entries in enumerate(comp.logprobs):
                for tok, lp in entries.items():
                    if tok < vocab:
                        logits[j, tok] = lp.logprob
            if torch.isnan(logits).any():
                raise RuntimeError("vLLM returned fewer logprobs than the vocabulary size")
            rows.append(
                {
                    "prompt_ids": prompt,
                    "gen_ids": list(comp.token_ids),
                    "logits": logits,
                    "num_cached_tokens": res.num_cached_tokens,
                }
            )
        step = delta(before, after)
        out.append(
            {
                "rows": rows,
                "hits": step.get("vllm:prefix_cache_hits", 0),
                "queries": step.get("vllm:prefix_cache_queries", 0),
                "counters": step,
            }
        )
    torch.save(out, out_path)


def engine_run(model_dir, runs, max_tokens: int | list[int], llm_kwargs: dict, env: dict | None = None) -> list[dict]:
    """This module on one engine in a subprocess: per batch of ``runs``, its rows (prompt, generated
    tokens, raw logits of each generated step, cached prompt tokens) and vLLM's counters over that batch."""
    import torch

    spec = {"model": str(model_dir), "runs": runs, "max_tokens": max_tokens, "llm_kwargs": llm_kwargs}
    with tempfile.TemporaryDirectory(prefix="engine-run-") as tmp:
        spec_path, out = Path(tmp) / "spec.json", Path(tmp) / "out.pt"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run(
            [sys.executable, "-m", "ascend_adapters.testing.engine_worker", str(spec_path), str(out)],
            env={**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **(env or {})},
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0 and out.exists(), (proc.stdout + proc.stderr)[-6000:]
        return torch.load(out)


if __name__ == "__main__":
    main(*sys.argv[1:])
