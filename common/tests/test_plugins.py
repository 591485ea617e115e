"""Every installed ascend-adapters plugin hook is idempotent and registers lazily."""

import importlib
import importlib.metadata as md
import subprocess
import sys

import pytest

HOOKS = [e for e in md.entry_points(group="vllm.general_plugins") if e.value.startswith("ascend_adapters.")]


def test_common_hooks_are_declared():
    names = {e.name for e in HOOKS}
    assert {"ascend_adapters_common", "ascend_adapters_probe"} <= names


@pytest.mark.parametrize("hook", HOOKS, ids=lambda e: e.name)
def test_register_is_idempotent_and_lazy(hook, monkeypatch):
    from vllm import ModelRegistry

    monkeypatch.setenv("ASCEND_ADAPTERS_TEST_PROBE", "1")
    register = hook.load()
    register()
    register()  # vLLM calls it once per process, possibly more: must not fail or duplicate
    module = importlib.import_module(hook.value.split(":")[0])
    archs = getattr(module, "ARCHITECTURES", None) or getattr(module, "PROBE_ARCHITECTURES", {})
    for arch, target in archs.items():
        assert arch in ModelRegistry.get_supported_archs(), arch
        mod_name = target.split(":")[0]
        assert target.count(":") == 1 and mod_name.startswith("ascend_adapters.")


def test_probe_registers_nothing_unless_enabled():
    code = (
        "import os; os.environ.pop('ASCEND_ADAPTERS_TEST_PROBE', None)\n"
        "from ascend_adapters.common.testing import probe\n"
        "from vllm import ModelRegistry\n"
        "probe.register()\n"
        "print(any(a in ModelRegistry.get_supported_archs() for a in probe.PROBE_ARCHITECTURES))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
