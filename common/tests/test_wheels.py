"""What users install carries no test code, and what users run works without the test layer.

The test layer is its own distribution (ascend-adapters-testing, installed by nox, never by users).
These tests build the wheels of the four user distributions and read them, and import what a user
runs (the deployment gate, the ``ascend-adapters`` command, the demo, every adapter's ``tiny``)
in a process where ``ascend_adapters.testing`` cannot be imported.
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
USER_DISTRIBUTIONS = {
    "ascend-adapters-common": ROOT / "common",
    "ascend-adapters-rwkv7": ROOT / "models" / "rwkv7",
    "ascend-adapters-glm-dsa": ROOT / "models" / "glm_dsa",
    "ascend-adapters-deepseek-v4": ROOT / "models" / "deepseek_v4",
}
ADAPTERS = ("rwkv7", "glm_dsa", "deepseek_v4")
TESTING = "ascend_adapters.testing"
PROBE_ENTRY_POINT = "ascend_adapters_probe"


def _test_code(name: str) -> str | None:
    """Why a wheel member is test code, or None."""
    parts = name.split("/")
    base = parts[-1]
    if name.startswith("ascend_adapters/testing/"):
        return "the test layer (ascend_adapters.testing)"
    if "tests" in parts[:-1] or base.startswith("test_") or base == "conftest.py":
        return "a test module"
    if base.startswith("_") and base.endswith("_ref.py"):
        return "a test reference (_*_ref.py)"
    if base in ("npu_emulator.py", "modelslim.py", "probe.py", "probe_models.py", "parity.py", "parity_worker.py"):
        return "a test-layer module (emulator, exporter, probe, parity harness)"
    return None


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    """Each user distribution built as a wheel from a clean copy of its sources (no stale build/ dirs)."""
    pytest.importorskip("setuptools", reason="building the wheels needs setuptools in the test venv")
    out = tmp_path_factory.mktemp("wheels")
    built = {}
    for dist, src in USER_DISTRIBUTIONS.items():
        copy = out / "src" / src.name
        shutil.copytree(src, copy, ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__"))
        dest = out / dist
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(dest),
             str(copy)],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, f"pip wheel {src.relative_to(ROOT)} failed:\n{proc.stdout}\n{proc.stderr}"
        found = sorted(dest.glob("*.whl"))
        assert len(found) == 1, f"{dist}: expected one wheel in {dest}, found {found}"
        built[dist] = found[0]
    return built


@pytest.mark.parametrize("dist", list(USER_DISTRIBUTIONS))
def test_user_wheel_has_no_test_code(wheels, dist):
    with zipfile.ZipFile(wheels[dist]) as whl:
        names = whl.namelist()
    sources = [n for n in names if n.startswith("ascend_adapters/") and n.endswith(".py")]
    assert sources, f"{wheels[dist].name} holds no ascend_adapters sources: the check reads the wrong thing"
    bad = [f"{n}: {why}" for n in names if (why := _test_code(n))]
    assert not bad, f"{wheels[dist].name} ships test code:\n" + "\n".join(bad)


@pytest.mark.parametrize("dist", list(USER_DISTRIBUTIONS))
def test_user_wheel_registers_no_test_plugin(wheels, dist):
    with zipfile.ZipFile(wheels[dist]) as whl:
        eps = [n for n in whl.namelist() if n.endswith(".dist-info/entry_points.txt")]
        assert len(eps) == 1, f"{wheels[dist].name}: expected one entry_points.txt, found {eps}"
        parser = configparser.ConfigParser()
        parser.read_string(whl.read(eps[0]).decode())
    plugins = dict(parser["vllm.general_plugins"]) if parser.has_section("vllm.general_plugins") else {}
    assert plugins, f"{wheels[dist].name} registers no vllm.general_plugins hook: the check reads the wrong thing"
    bad = {name: value for name, value in plugins.items() if name == PROBE_ENTRY_POINT or TESTING in value}
    assert not bad, f"{wheels[dist].name} registers a test plugin: {bad}"


def test_the_testing_distribution_registers_the_probe():
    """The counterpart: the probe plugin is declared by ascend-adapters-testing, where nox installs it."""
    import tomllib

    project = tomllib.loads((ROOT / "testing" / "pyproject.toml").read_text())["project"]
    assert project["name"] == "ascend-adapters-testing"
    assert project["entry-points"]["vllm.general_plugins"][PROBE_ENTRY_POINT] == f"{TESTING}.probe:register"
    for dist, src in USER_DISTRIBUTIONS.items():
        user = tomllib.loads((src / "pyproject.toml").read_text())["project"]
        requirements = user.get("dependencies", []) + sum(user.get("optional-dependencies", {}).values(), [])
        bad = [r for r in requirements if r.replace("_", "-").lower().startswith("ascend-adapters-testing")]
        assert not bad, f"{dist} depends on the test layer: {bad}"


BLOCKER = textwrap.dedent(
    f"""
    import importlib, sys

    class NoTestLayer:
        def find_spec(self, name, path=None, target=None):
            if name == {TESTING!r} or name.startswith({TESTING!r} + "."):
                raise ModuleNotFoundError(f"No module named {{name!r}} (the test layer is not installed)", name=name)
            return None

    sys.meta_path.insert(0, NoTestLayer())
    for name in sys.argv[1:]:
        importlib.import_module(name)
    from ascend_adapters.common.cli import build_parser

    commands = set(build_parser()._subparsers._group_actions[0].choices)
    missing = {{"status", "check", "manifest", "render", "gate", "evidence"}} - commands
    assert not missing, f"ascend-adapters lacks {{sorted(missing)}} without the test layer"
    loaded = sorted(m for m in sys.modules if m == {TESTING!r} or m.startswith({TESTING!r} + "."))
    assert not loaded, loaded
    print("imported", len(sys.argv) - 1, "modules without the test layer")
    """
)


def test_what_users_run_imports_without_the_test_layer():
    modules = [
        "ascend_adapters.common.gate",
        "ascend_adapters.common.gate.cli",
        "ascend_adapters.common.gate.runner",
        "ascend_adapters.common.cli",
        "ascend_adapters.common.demo",
        "ascend_adapters.common.status",
        "ascend_adapters.common.evidence",
        "ascend_adapters.common.evidence.cli",
        *(f"ascend_adapters.{a}.tiny" for a in ADAPTERS),
    ]
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKER, *modules], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert proc.returncode == 0, f"importing with the test layer blocked failed:\n{proc.stderr[-4000:]}"
    assert f"imported {len(modules)} modules" in proc.stdout, proc.stdout


def test_the_blocker_blocks():
    """The blocker really hides the test layer (else the test above proves nothing)."""
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKER, f"{TESTING}.probe"], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert proc.returncode != 0 and "the test layer is not installed" in proc.stderr, proc.stderr[-2000:]
