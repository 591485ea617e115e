"""The first real gate: a plain tiny Llama served through the probe plugin.

Proves plugin discovery in vLLM's subprocesses, the serve harness, and
parity against transformers' LlamaForCausalLM on the same weights.
"""

import json

import pytest
import torch

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.common.server import ServerStartError, VllmServer
from ascend_adapters.testing.factory import make_tiny_llama
from ascend_adapters.testing.parity import compare, vllm_logits
from ascend_adapters.testing.probe import PROBE_ENV

ARCH = "AscendProbeLlamaForCausalLM"
OVERRIDE = json.dumps({"architectures": [ARCH]})


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "tiny-llama", seed=0)


@pytest.mark.vllm
@pytest.mark.gate
def test_llama_probe_gate(llama_dir, evidence_root):
    rec = EvidenceRecord(model="llama_probe", gate="serve_and_parity")
    args = [
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "256",
        "--kv-cache-memory-bytes",
        "64M",
        "--max-num-seqs",
        "4",
        "--hf-overrides",
        OVERRIDE,
    ]
    with VllmServer(llama_dir, args, env={PROBE_ENV: "1"}) as srv:
        rec.command(srv.cmd)
        rec.metric("startup_s", round(srv.timings.startup_s, 2))
        models = srv.models()
        rec.check("GET /v1/models 200", models["data"][0]["id"] == str(llama_dir))
        comp = srv.complete("The capital of France is", max_tokens=8)
        text = comp["choices"][0]["text"]
        rec.check("completion 200, non-empty", bool(text), text)
        chat = srv.chat([{"role": "user", "content": "Hello"}], max_tokens=8)
        rec.check("chat completion 200", chat["choices"][0]["message"]["content"] is not None)
        log = srv.log_text()
    resolved = f"Resolved architecture: {ARCH}" in log
    rec.check("probe architecture resolved through the plugin", resolved)
    assert text and resolved

    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42], list(range(100, 140))]
    runs = vllm_logits(
        llama_dir,
        [prompts, [prompts[1]]],
        max_tokens=8,
        llm_kwargs={"hf_overrides": {"architectures": [ARCH]}},
        env={PROBE_ENV: "1"},
    )
    rec.command(f"vllm.LLM({llama_dir}, hf_overrides={OVERRIDE}, dtype=float32) raw logits, batched + single")
    from transformers import LlamaForCausalLM

    ref_model = LlamaForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()

    def reference(ids):
        with torch.no_grad():
            return ref_model(torch.tensor([ids])).logits[0]

    batched, single = compare(runs[0], reference), compare(runs[1], reference)
    rec.metric("max_abs_logit_diff_batched", batched.max_abs_diff)
    rec.metric("max_abs_logit_diff_single", single.max_abs_diff)
    rec.check("logits within 1e-4 of transformers", max(batched.max_abs_diff, single.max_abs_diff) < 1e-4)
    rec.check(
        "greedy tokens identical",
        batched.tokens_identical and single.tokens_identical,
        batched.first_divergence or single.first_divergence,
    )
    rec.check("batched == single", runs[0][1].gen_ids == runs[1][0].gen_ids)
    rec.skip("NPU path", "no Ascend NPU on this machine; the portable path ran")
    path = rec.write(evidence_root)

    saved = json.loads(path.read_text())
    assert saved["passed"], saved["checks"]
    assert saved["versions"]["torch"] and saved["commands"]
    index = (evidence_root / "index.md").read_text()
    rows = [x for x in index.splitlines() if x.startswith("| llama_probe | serve_and_parity |")]
    assert len(rows) == 1 and f"[PASS](llama_probe/{path.name})" in rows[0], rows


@pytest.mark.vllm
def test_start_failure_is_reported_and_cleaned_up(tmp_path):
    missing = tmp_path / "no-such-model"
    missing.mkdir()
    srv = VllmServer(missing, startup_timeout=300)
    with pytest.raises(ServerStartError) as exc:
        srv.start()
    assert exc.value.returncode not in (None, 0)
    assert not srv.alive
