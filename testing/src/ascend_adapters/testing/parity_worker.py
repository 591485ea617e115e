"""Subprocess side of parity.vllm_logits (run with -m; reads a JSON spec)."""

from __future__ import annotations

import json
import os
import sys


def _dense(entries, vocab: int):
    import torch

    row = torch.full((vocab,), float("nan"), dtype=torch.float32)
    for tok, lp in entries.items():
        if tok < vocab:
            row[tok] = lp.logprob
    return row


def main(spec_path: str, out_path: str) -> int:
    import torch
    from vllm import LLM, SamplingParams

    spec = json.loads(open(spec_path).read())
    if spec.get("probe"):  # LLM.apply_model ships the probe function to the engine core by pickle
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    llm = LLM(
        model=spec["model"], skip_tokenizer_init=True, logprobs_mode="raw_logits", max_logprobs=-1, **spec["llm_kwargs"]
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(
        temperature=0.0,
        max_tokens=spec["max_tokens"],
        logprobs=-1,
        prompt_logprobs=-1,
        detokenize=False,
        ignore_eos=True,
    )
    out = []
    for batch in spec["runs"]:
        results = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        rows = []
        for prompt, res in zip(batch, results):
            comp = res.outputs[0]
            prompt_rows = [_dense(e, vocab) for e in res.prompt_logprobs[1:]]
            gen_rows = [_dense(e, vocab) for e in comp.logprobs]
            logits = torch.stack(prompt_rows + gen_rows)
            if torch.isnan(logits).any():
                raise RuntimeError("vLLM returned fewer logprobs than the vocabulary size")
            rows.append({"prompt_ids": prompt, "gen_ids": list(comp.token_ids), "logits": logits})
        out.append(rows)
    probed = None
    if spec.get("probe"):
        import importlib

        module, fn = spec["probe"].split(":")
        probed = llm.apply_model(getattr(importlib.import_module(module), fn))
    torch.save({"runs": out, "probe": probed}, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
