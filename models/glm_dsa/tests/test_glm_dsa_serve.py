"""`vllm serve DIR` with a long --max-model-len and no adapter flags (compiled default mode, not
--enforce-eager): the sparse path is chosen by itself and greedy completions over HTTP equal
transformers' greedy generation on the same checkpoint."""

from __future__ import annotations

import pytest
import torch
from _glm_dsa_ref import Reference, build, random_prompts

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.common.server import VllmServer


@pytest.mark.vllm
@pytest.mark.gate
def test_serve_sparse_http(tmp_path, evidence_root):
    rec = EvidenceRecord(model="glm_dsa", gate="serve_sparse")
    ckpt = build(tmp_path, "tiny", index_topk=8)
    args = ["--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory-bytes", "64M", "--max-num-seqs", "4"]
    prompts = random_prompts([40, 9], seed=9)
    with VllmServer(ckpt, args) as srv:
        rec.command(srv.cmd)
        rec.metric("startup_s", round(srv.timings.startup_s, 2))
        outs = [srv.complete(p, max_tokens=16, return_token_ids=True)["choices"][0] for p in prompts]
        text = srv.complete("The capital of France is", max_tokens=8)["choices"][0]["text"]
        log = srv.log_text()
    rec.check("text completion answered", isinstance(text, str) and len(text) > 0, text)
    sparse = "GLM-DSA attention path: sparse" in log
    rec.check("sparse path chosen automatically (logged)", sparse)
    model = Reference(ckpt).model
    ok_all = True
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :].tolist()
        ok = out["token_ids"] == ref
        ok_all &= ok
        rec.check(
            f"greedy over HTTP == transformers generate (prompt {len(p)} tokens, 16 new)",
            ok,
            {"vllm": out["token_ids"], "transformers": ref},
        )
    rec.write(evidence_root)
    assert sparse and ok_all and text
