"""The deployment gate runs a pipeline-parallel layout end to end: admission, the dummy-weight stage and
the real-weight stage, each `vllm serve` with the same --pipeline-parallel-size 2 (the dummy stage must
not hide a layout the real one cannot serve), on RWKV-7's tiny checkpoint (an adapter with SupportsPP)."""

from __future__ import annotations

import json

import pytest

from ascend_adapters.common.admission import build_manifest, dump_manifest
from ascend_adapters.common.cli import main as cli_main
from ascend_adapters.common.evidence import record_name
from ascend_adapters.common.gate import GATE_NAME
from ascend_adapters.common.server import CPU_TEST_ARGS
from ascend_adapters.rwkv7.tiny import make_tiny

NAME = "rwkv7_pp2"


@pytest.mark.vllm
def test_gate_runs_a_pipeline_parallel_layout_end_to_end(tmp_path, evidence_root, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per stage
    model = make_tiny(tmp_path / "tiny-rwkv7")
    manifest_obj, report = build_manifest(model, progress=False)
    assert manifest_obj is not None, report.format()
    manifest = tmp_path / "tiny.manifest.json"
    dump_manifest(manifest_obj, manifest)
    serve = [*CPU_TEST_ARGS, "--pipeline-parallel-size", "2", "--distributed-executor-backend", "mp"]
    rc = cli_main(["gate", str(model), "--manifest", str(manifest), "--name", NAME, "--max-tokens", "8",
                   "--evidence-dir", str(evidence_root), "--log-dir", str(tmp_path / "logs"), "--", *serve])  # fmt: skip
    out = capsys.readouterr().out
    rec = json.loads((evidence_root / NAME / record_name(GATE_NAME)).read_text())
    assert rc == 0 and rec["passed"], (out, [c for c in rec["checks"] if not c["passed"]])
    assert rec["extra"]["parallel"]["pipeline_parallel_size"] == 2
    dummy_cmd, real_cmd = rec["commands"][1:]  # [0] is admission
    for cmd in (dummy_cmd, real_cmd):
        assert "--pipeline-parallel-size 2" in cmd, cmd
    assert dummy_cmd.endswith("--load-format dummy") and "--load-format" not in real_cmd
    checks = {c["name"]: c["passed"] for c in rec["checks"]}
    for name in (
        "dummy: start-up (GET /v1/models 200)",
        "real: start-up (GET /v1/models 200)",
        "real: completion output non-empty",
        "real: greedy request sent twice gives identical output",
    ):
        assert checks.get(name), (name, sorted(checks))  # fmt: skip
