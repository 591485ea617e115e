"""Faults (issue #49, item 3): a worker killed mid-generation, a checkpoint changed after its manifest, an
interrupted record write.

* A worker SIGKILLed while it generates: vLLM shuts its HTTP server down within a second but exits 0;
  ``compat.engine_faults`` makes ``vllm serve`` exit ``ENGINE_DIED_EXIT`` with one line naming the cause,
  and the deployment gate, whose server it is, reports it (false ready, the line in its record) without
  hanging. One real engine start (the gate's dummy-weight stage, tiny RWKV-7).
* A checkpoint file changed after its manifest was written: the next ``vllm serve`` (and the next gate) is
  refused by admission before any engine starts, naming the file. No engine starts.
* Records: ``EvidenceRecord.write`` (the gate's writer too) and the index are written to a temporary file
  and renamed over the record; a writer killed at random points mid-write leaves the previous record whole.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ascend_adapters.common.admission import build_manifest, dump_manifest
from ascend_adapters.common.admission.hook import EXIT_CODE as ADMISSION_REFUSED_EXIT
from ascend_adapters.common.admission.hook import MANIFEST_ENV
from ascend_adapters.common.compat.engine_faults import ENGINE_DIED_EXIT, ENGINE_DIED_PREFIX
from ascend_adapters.common.evidence import EvidenceRecord, record_name
from ascend_adapters.common.gate import runner as gate_runner
from ascend_adapters.common.server import CPU_TEST_ARGS, ServerStartError, VllmServer, group_members

EXIT_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny RWKV-7 (World tokenizer) and its admission manifest."""
    from ascend_adapters.rwkv7.tiny import make_tiny

    root = tmp_path_factory.mktemp("faults")
    model = make_tiny(root / "tiny-rwkv7")
    manifest, report = build_manifest(model)
    assert report.ok, report.format()
    path = root / "tiny-rwkv7.manifest.json"
    dump_manifest(manifest, path)
    return model, path


def _workers(pgid: int) -> list[int]:
    found = []
    for pid in group_members(pgid):
        try:
            if "Worker" in Path(f"/proc/{pid}/comm").read_text():
                found.append(pid)
        except OSError:
            continue
    return found


def _kill_worker_mid_generation(srv: VllmServer, out: dict) -> None:
    """Stream a long completion; once tokens flow, SIGKILL the worker; wait for the server to exit."""
    payload = {"model": srv.model_name, "prompt": "The", "max_tokens": 200, "temperature": 0.0,
               "ignore_eos": True, "stream": True}  # fmt: skip
    req = urllib.request.Request(
        srv.base_url + "/v1/completions",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    resp = urllib.request.urlopen(req, timeout=120)
    chunks = 0
    while chunks < 2:  # generation is under way
        line = resp.readline().decode()
        if line.startswith("data: {"):
            chunks += 1
        assert line, "the stream ended before two chunks"
    workers = _workers(srv.proc.pid)
    assert workers, f"no worker process in the server's group: {group_members(srv.proc.pid)}"
    t0 = time.monotonic()
    os.kill(workers[0], signal.SIGKILL)
    try:
        out["rc"] = srv.proc.wait(timeout=EXIT_WITHIN_S + 30)
    except subprocess.TimeoutExpired:
        out["rc"] = None
    out["exit_s"] = time.monotonic() - t0
    try:  # what the client in flight got
        out["stream_rest"] = resp.read().decode("utf-8", "replace")[-2000:]
    except Exception as exc:  # the connection dropped
        out["stream_rest"] = f"{type(exc).__name__}: {exc}"


def test_engine_death_line_names_the_first_cause(tmp_path):
    from ascend_adapters.common.compat import engine_faults

    faults = tmp_path / "faults.log"
    faults.write_text(
        "pid=12 Worker proc VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor.\n"
        "pid=11 EngineCore encountered a fatal error. (RuntimeError: cancelled)\n"
    )
    cause = engine_faults.read_cause(str(faults))
    assert cause == "Worker proc VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor."
    line = engine_faults.engine_death_line(cause)
    assert line.startswith(ENGINE_DIED_PREFIX) and line.endswith(cause) and "\n" not in line
    assert engine_faults.read_cause(str(tmp_path / "absent")) is None
    assert "not logged" in engine_faults.engine_death_line(None)
    assert gate_runner.engine_death(f"INFO x\n{line}\nINFO y") == line
    assert gate_runner.engine_death(f"(APIServer pid=7) {line}") == line
    assert gate_runner.engine_death("INFO x") is None


@pytest.mark.vllm
def test_worker_killed_mid_generation_exits_nonzero_and_gate_reports_it(tiny, tmp_path, monkeypatch):
    model, manifest = tiny
    evidence, logs = tmp_path / "evidence", tmp_path / "logs"
    killed: dict = {}
    requests = gate_runner._Gate._requests

    def requests_after_the_kill(self, stage, srv):
        if stage == "dummy" and not killed:
            _kill_worker_mid_generation(srv, killed)
        return requests(self, stage, srv)

    monkeypatch.setattr(gate_runner._Gate, "_requests", requests_after_the_kill)
    opts = gate_runner.GateOptions(model_dir=model, serve_args=list(CPU_TEST_ARGS), manifest=manifest,
                                   evidence_dir=evidence, name="faults", log_dir=logs, startup_timeout=900,
                                   request_timeout=120)  # fmt: skip
    t0 = time.monotonic()
    result = gate_runner.run_gate(opts)
    gate_s = time.monotonic() - t0

    # the server: non-zero, within 30 s, one line naming the cause
    log = (logs / "dummy.log").read_text(errors="replace")
    assert killed.get("rc") == ENGINE_DIED_EXIT, (killed, log[-4000:])
    assert killed["exit_s"] < EXIT_WITHIN_S, killed
    lines = [line[line.index(ENGINE_DIED_PREFIX) :] for line in log.splitlines() if ENGINE_DIED_PREFIX in line]
    assert len(lines) == 1, log[-4000:]
    assert "Worker proc VllmWorker-0 died unexpectedly" in lines[0], lines[0]  # vLLM's exit code: -9 or None

    # the gate: reports it, does not hang, writes its record
    assert result.exit_code == 1 and result.verdict == "false_ready", result
    assert gate_s < 900, gate_s
    rec = json.loads(result.record_path.read_text())
    dummy = rec["extra"]["stages"]["dummy"]
    assert dummy["exit_code"] == ENGINE_DIED_EXIT, dummy
    assert dummy["engine_died"] == lines[0], dummy
    assert any("died unexpectedly" in note for note in rec["notes"]), rec["notes"]
    assert "real" not in rec["extra"]["stages"]
    assert not group_members(dummy["pid"]), "server processes left behind"


@pytest.mark.vllm  # starts `vllm serve` (refused before any engine), as test_admission_serve.py
def test_changed_checkpoint_refused_at_next_start(tiny, tmp_path):
    """A checkpoint file changed after its manifest: the next `vllm serve` exits 3 before any engine starts,
    naming the file; so does the gate (admission refused, no server)."""
    import shutil

    model, manifest = tiny
    changed = tmp_path / "tiny-rwkv7"
    shutil.copytree(model, changed)
    weights = changed / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-7] ^= 0x10  # one bit of the last tensor's data: same size, same header
    weights.write_bytes(bytes(raw))

    srv = VllmServer(changed, env={MANIFEST_ENV: str(manifest), "HF_HUB_OFFLINE": "1"}, startup_timeout=300,
                     log_path=tmp_path / "serve.log")  # fmt: skip
    with pytest.raises(ServerStartError) as info:
        with srv:
            pass
    log = srv.log_text()
    assert info.value.returncode == ADMISSION_REFUSED_EXIT, log
    refusal = [line for line in log.splitlines() if "admission REFUSED" in line]
    assert refusal and "[file-sha256] model.safetensors" in refusal[0], log
    for later in ("EngineCore", "Loading weights", "Resolved architecture"):
        assert later not in log, f"{later!r} appeared before the refusal:\n{log}"

    opts = gate_runner.GateOptions(model_dir=changed, serve_args=list(CPU_TEST_ARGS), manifest=manifest,
                                   evidence_dir=tmp_path / "evidence", name="changed")  # fmt: skip
    result = gate_runner.run_gate(opts)
    assert result.exit_code == 1 and result.verdict == "admission_refused", result
    rec = json.loads(result.record_path.read_text())
    assert not rec["passed"] and "stages" in rec["extra"] and not rec["extra"]["stages"], rec["extra"]


# -- atomic records ----------------------------------------------------------------------------------------

_WRITER = r"""
import sys, time
from ascend_adapters.common.evidence import atomic_write_text
path, n, payload = sys.argv[1], 0, "x" * (16 << 20)  # 16 MiB: the write takes a while
while True:
    n += 1
    text = f'{{"generation": {n}, "payload": "{payload}{n}"}}'  # a copy: the loop is the write
    t0 = time.monotonic()
    atomic_write_text(path, text)
    print(f"wrote {n} {time.monotonic() - t0:.4f}", flush=True)
"""


def _previous(root: Path) -> dict:
    rec = EvidenceRecord(model="atomic", gate="record")
    rec.extra["generation"] = 0
    rec.extra["payload"] = "previous 0"
    rec.check("whole", True)
    path = rec.write(root)
    return json.loads(path.read_text())


def test_record_write_interrupted_leaves_previous_record_whole(tmp_path, monkeypatch):
    """An exception (Ctrl-C) in the middle of a write: the previous record and index stay as they were."""
    root = tmp_path / "evidence"
    before = _previous(root)
    path = root / "atomic" / record_name("record")
    index = (root / "index.md").read_text()

    def interrupted(fd):
        raise KeyboardInterrupt  # after the new text was written to the temporary file, before the rename

    monkeypatch.setattr(os, "fsync", interrupted)
    rec = EvidenceRecord(model="atomic", gate="record")
    rec.extra["generation"] = 1
    with pytest.raises(KeyboardInterrupt):
        rec.write(root)
    assert json.loads(path.read_text()) == before
    assert (root / "index.md").read_text() == index
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name], "a temporary file was left behind"


def test_record_writer_killed_mid_write_leaves_a_whole_record(tmp_path):
    """The writer (``atomic_write_text``, what records and the index go through) rewriting a 16 MiB file in a
    loop, SIGKILLed at moments spread over a write until five kills have landed mid-write (its temporary file
    left behind): every time the file on disk is one whole write."""
    path = tmp_path / "record.json"
    path.write_text(json.dumps({"generation": 0, "payload": "previous 0"}))
    mid_write = tries = 0
    while mid_write < 5:
        tries += 1
        assert tries <= 40, f"only {mid_write} of {tries - 1} kills landed mid-write"
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True)
        _, _, took = proc.stdout.readline().split()  # one write done; the next starts now
        time.sleep(float(took) * (tries % 10) / 10)
        proc.kill()
        proc.wait()
        proc.stdout.close()
        rec = json.loads(path.read_text())  # never a partial file
        assert rec["generation"] >= 1 and rec["payload"].endswith(str(rec["generation"])), "not one whole write"
        left = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        mid_write += bool(left)
        for p in left:  # a SIGKILLed writer leaves its temporary file, never a partial record
            assert p.name.startswith(f".{path.name}."), p
            p.unlink()
