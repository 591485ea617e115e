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
        "from ascend_adapters.testing import probe\n"
        "from vllm import ModelRegistry\n"
        "probe.register()\n"
        "print(any(a in ModelRegistry.get_supported_archs() for a in probe.PROBE_ARCHITECTURES))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


# Laziness, checked where it matters: a fresh process (as vLLM starts one), sys.modules before and after. One
# process for every hook: each hook is imported before vLLM (torch and vLLM still absent after each), then each
# registers in turn and no target or heavy module of any registered so far may be imported.
_LAZY_PROBE = r"""
import importlib, json, os, sys
os.environ["ASCEND_ADAPTERS_TEST_PROBE"] = "1"
hooks, out = {}, {}
for value in sys.argv[1:]:
    module_name, func = value.split(":")
    hooks[value] = (importlib.import_module(module_name), func)
    out[value] = {"hook_imports_torch": "torch" in sys.modules, "hook_imports_vllm": "vllm" in sys.modules}
from vllm import ModelRegistry  # noqa: E402,F401  vLLM has imported torch and its config before it loads plugins
targets = set()
for value, (hook, func) in hooks.items():
    getattr(hook, func)()
    archs = getattr(hook, "ARCHITECTURES", None) or getattr(hook, "PROBE_ARCHITECTURES", {})
    targets |= {t.split(":")[0] for t in archs.values()}
    out[value]["targets"] = sorted(targets)
    out[value]["targets_imported"] = sorted(m for m in targets if m in sys.modules)
    out[value]["heavy_imported"] = sorted(m for m in sys.modules if m.startswith("ascend_adapters.") and
                                          m.rsplit(".", 1)[-1] in ("model", "kernels", "probe_models", "wkv", "backend"))
print("LAZY " + json.dumps(out))
"""


def test_hooks_are_lazy_in_a_fresh_process():
    """Importing a hook costs nothing (no torch, no vLLM); register() imports no model or kernel module."""
    import json

    values = [hook.value for hook in HOOKS]
    out = subprocess.run([sys.executable, "-c", _LAZY_PROBE, *values], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("LAZY "))[5:])
    assert sorted(res) == sorted(values), res
    for value, r in res.items():
        assert not r["hook_imports_torch"] and not r["hook_imports_vllm"], (value, r)
        assert r["targets_imported"] == [], (value, r)
        assert r["heavy_imported"] == [], (value, r)


@pytest.mark.parametrize("hook", HOOKS, ids=lambda e: e.name)
def test_status_notes_name_a_function_returning_lines(hook):
    """A hook's optional ``STATUS_NOTES`` is a lazy "module:function" whose lines ``status`` prints."""
    from ascend_adapters.common.registry import status_notes

    spec = getattr(importlib.import_module(hook.value.split(":")[0]), "STATUS_NOTES", None)
    if spec is None:
        return
    assert isinstance(spec, str) and spec.count(":") == 1 and spec.startswith("ascend_adapters."), spec
    lines = status_notes(spec)
    assert lines and all(isinstance(x, str) and x for x in lines), lines
    assert not lines[0].startswith(f"status notes {spec} unavailable"), lines


def test_status_notes_failure_is_one_line():
    from ascend_adapters.common.registry import status_notes

    (line,) = status_notes("ascend_adapters.common.registry:no_such_function")
    assert line.startswith("status notes ascend_adapters.common.registry:no_such_function unavailable (AttributeError")
