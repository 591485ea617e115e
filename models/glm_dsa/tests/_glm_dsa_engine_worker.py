"""Subprocess: prompt batches one after another on one vLLM engine; per request the generated tokens and
the raw logits of every generated step, per batch vLLM's speculative-decoding counters.

``python _glm_dsa_engine_worker.py SPEC_JSON OUT_PT``; the spec holds ``model``, ``runs`` (batches of
token-id prompts), ``max_tokens`` and ``llm_kwargs``. The counters are read before and after each batch
(``LLM.get_metrics``): drafts, draft tokens, accepted tokens, accepted tokens per draft position.
"""

import json
import sys

COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[m.name] = out.get(m.name, 0) + int(m.value)
        elif m.name == PER_POSITION:
            old = out.get(m.name, [0] * len(m.values))
            out[m.name] = [a + int(b) for a, b in zip(old, m.values)]
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
            rows.append({"prompt_ids": prompt, "gen_ids": list(comp.token_ids), "logits": logits})
        counters = {}
        for name, value in after.items():
            old = before.get(name)
            counters[name] = (
                [a - b for a, b in zip(value, old or [0] * len(value))]
                if isinstance(value, list)
                else value - (old or 0)
            )
        out.append({"rows": rows, "counters": counters})
    torch.save(out, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
