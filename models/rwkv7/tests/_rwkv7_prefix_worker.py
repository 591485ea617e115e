"""Subprocess: run prompt batches one after another on one vLLM engine and report, per
request, the generated tokens, their raw logits and vLLM's own prefix-cache accounting.

``python _rwkv7_prefix_worker.py SPEC_JSON OUT_PT``; the spec holds ``model``, ``runs``
(a list of batches of token-id prompts), ``max_tokens`` and ``llm_kwargs``. No prompt
logprobs are asked for: vLLM does not read the prefix cache for requests that want them.
After each batch the engine's counters ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``
are read (``LLM.get_metrics``).
"""

import json
import sys


def _counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"):
            out[m.name] = out.get(m.name, 0) + int(m.value)
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
    params = SamplingParams(
        temperature=0.0, max_tokens=spec["max_tokens"], logprobs=-1, detokenize=False, ignore_eos=True
    )
    out = []
    for batch in spec["runs"]:
        before = _counters(llm)
        results = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        after = _counters(llm)
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
        out.append(
            {
                "rows": rows,
                "hits": after.get("vllm:prefix_cache_hits", 0) - before.get("vllm:prefix_cache_hits", 0),
                "queries": after.get("vllm:prefix_cache_queries", 0) - before.get("vllm:prefix_cache_queries", 0),
            }
        )
    torch.save(out, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
