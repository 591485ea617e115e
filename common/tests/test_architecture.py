"""The import rules and rooms of docs/architecture.md, checked mechanically (AST scan, nothing imported).

* common never imports an adapter; an adapter never imports another adapter.
* Engine versions are known in one place: ``engine_version`` and the engine's own version
  (``vllm.__version__``, ``vllm.version``) appear only in common/compat/; adapters import no
  ``packaging`` (no version comparisons of their own).
* Every adapter package has the same rooms, its ``__init__`` imports no torch/vLLM/transformers at
  module level, and test-only references live under tests/, not in the wheel.
* common's rooms are the ones docs/architecture.md names; nothing a user runs (common, the adapters)
  imports the test layer ``ascend_adapters.testing`` (its own distribution, see test_wheels.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMON_SRC = ROOT / "common" / "src" / "ascend_adapters" / "common"
COMPAT = COMMON_SRC / "compat"
TESTING = "ascend_adapters.testing"
ADAPTERS = sorted(p.name for p in (ROOT / "models").iterdir() if (p / "src" / "ascend_adapters" / p.name).is_dir())
ROOMS = ("__init__.py", "config.py", "policy.py", "remap.py", "model.py", "kernels.py", "memory.py", "tiny.py")
# Rooms an adapter has when it has the role: mtp.py, the drafter of a model that drafts with its own MTP layers;
# backend.py, the attention backend (metadata builder) of a model whose layers attend over their own paged caches.
OPTIONAL_ROOMS = ("mtp.py", "backend.py")
# Files an adapter may have besides its rooms, each with a role docs/architecture.md names.
EXTRA_ROOMS = {
    "rwkv7": {"tokenizer.py", "convert.py", "train_tiny.py"},
    "glm_dsa": {"arch.py"},
    "deepseek_v4": {
        "attention.py",
        "compressor.py",
        "indexer.py",
        "rope.py",
        "moe.py",
        "dequant.py",
        "mhc.py",
    },
}
HEAVY = ("torch", "vllm", "transformers", "torch_npu")
VERSION_NAMES = {"engine_version"}
# The rooms of common (modules and packages under ascend_adapters/common/), each a row of
# docs/architecture.md's table "The rooms of common".
COMMON_ROOMS = {
    "__init__.py",
    "platform.py",
    "dispatch.py",
    "compat",
    "cpu_patches.py",
    "flags.py",
    "policy.py",
    "registry.py",
    "admission",
    "status.py",
    "plan.py",
    "quant",
    "kernels",
    "loading.py",
    "remap.py",
    "plugin.py",
    "cli.py",
    "demo.py",
    "gate",
    "server.py",
    "launcher.py",
    "evidence",
    "tokenizer.py",
    "versions.py",
    "attention_backend.py",
    "mtp.py",
}


def _src_files(pkg_dir: Path) -> list[Path]:
    return sorted(p for p in pkg_dir.rglob("*.py") if "__pycache__" not in p.parts)


def _adapter_dir(name: str) -> Path:
    return ROOT / "models" / name / "src" / "ascend_adapters" / name


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every import, absolute names only (``from . import x`` is package-local)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), filename=str(path))


def _adapter_imported(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "ascend_adapters" and len(parts) > 1 and parts[1] != "common":
        return parts[1]
    return None


def test_there_are_adapters_to_check():
    assert {"rwkv7", "glm_dsa", "deepseek_v4"} <= set(ADAPTERS)


def test_common_never_imports_an_adapter():
    bad = [
        f"{p.relative_to(ROOT)}:{line}: imports {mod}"
        for p in _src_files(COMMON_SRC)
        for line, mod in _imports(_parse(p))
        if _adapter_imported(mod)
    ]
    assert not bad, "common must not import adapters:\n" + "\n".join(bad)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_adapter_imports_only_itself_and_common(adapter):
    bad = [
        f"{p.relative_to(ROOT)}:{line}: imports {mod}"
        for p in _src_files(_adapter_dir(adapter))
        for line, mod in _imports(_parse(p))
        if _adapter_imported(mod) not in (None, adapter)
    ]
    assert not bad, f"{adapter} imports another adapter:\n" + "\n".join(bad)


def _version_uses(path: Path) -> list[str]:
    tree = _parse(path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in VERSION_NAMES:
            found.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in VERSION_NAMES:
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr == "__version__":
            if isinstance(node.value, ast.Name) and node.value.id == "vllm":
                found.append(f"{node.lineno}: vllm.__version__")
    for line, mod in _imports(tree):
        if (
            mod in ("vllm.__version__", "vllm.version")
            or mod.startswith("vllm.version.")
            or mod.endswith(tuple(f".{n}" for n in VERSION_NAMES))
        ):
            found.append(f"{line}: import {mod}")
    return found


def test_engine_versions_are_known_only_in_compat():
    files = _src_files(COMMON_SRC) + [f for a in ADAPTERS for f in _src_files(_adapter_dir(a))]
    files += sorted((ROOT / "models").glob("*/bench/*.py")) + sorted((ROOT / "common" / "bench").glob("*.py"))
    bad = [f"{p.relative_to(ROOT)}:{use}" for p in files if COMPAT not in p.parents for use in _version_uses(p)]
    assert not bad, "engine-version checks belong in common/compat/ (add a named function there):\n" + "\n".join(bad)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_adapters_compare_no_versions(adapter):
    bad = [
        f"{p.relative_to(ROOT)}:{line}: imports {mod}"
        for p in _src_files(_adapter_dir(adapter))
        for line, mod in _imports(_parse(p))
        if mod.split(".")[0] == "packaging"
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_same_rooms_in_every_adapter(adapter):
    have = {p.name for p in _adapter_dir(adapter).glob("*.py")}
    missing = set(ROOMS) - have
    assert not missing, f"{adapter} lacks {sorted(missing)}"
    unexplained = have - set(ROOMS) - set(OPTIONAL_ROOMS) - EXTRA_ROOMS.get(adapter, set())
    assert not unexplained, f"{adapter}: {sorted(unexplained)} have no room in docs/architecture.md"
    refs = [n for n in have if n.endswith("_ref.py") or "reference" in n]
    assert not refs, f"{adapter}: test references {refs} belong under models/{adapter}/tests/"


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_hook_module_is_light(adapter):
    """``register()`` runs in every vLLM process: the package's __init__ imports nothing heavy at module level."""
    init = _adapter_dir(adapter) / "__init__.py"
    tree = _parse(init)
    bad = []
    for node in tree.body:  # module level only; imports inside register() are lazy
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for line, mod in _imports(node):
                if mod.split(".")[0] in HEAVY or (_adapter_imported(mod) == adapter and mod.count(".") > 1):
                    bad.append(f"{line}: {mod}")
    assert not bad, f"{init.relative_to(ROOT)} imports at module level:\n" + "\n".join(bad)


def test_architecture_doc_names_every_room():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for room in ROOMS + OPTIONAL_ROOMS:
        assert f"`{room}`" in doc, room
    for adapter, extra in EXTRA_ROOMS.items():
        for room in extra:
            assert f"`{adapter}/{room}`" in doc, f"{adapter}/{room}"


def test_vendor_code_only_inside_functions():
    """torch_npu is imported lazily by NPU twins (behind common.dispatch), never at module level."""
    files = _src_files(COMMON_SRC) + [f for a in ADAPTERS for f in _src_files(_adapter_dir(a))]
    bad = [
        f"{p.relative_to(ROOT)}:{line}: {mod}"
        for p in files
        for node in _parse(p).body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for line, mod in _imports(node)
        if mod.split(".")[0] == "torch_npu"
    ]
    assert not bad, "\n".join(bad)


def _is_npu_twin(fn: ast.FunctionDef) -> bool:
    for d in fn.decorator_list:
        call = d.func if isinstance(d, ast.Call) else d
        if isinstance(call, ast.Attribute) and call.attr == "npu" and getattr(call.value, "id", None) == "dispatch":
            return True
    return False


def test_npu_twins_only_through_common_dispatch():
    """A function that imports torch_npu is an NPU twin registered with ``@dispatch.npu`` (or a private helper
    of a module that registers twins); ``common/platform.py`` alone asks torch_npu whether an NPU is there."""
    files = _src_files(COMMON_SRC) + [f for a in ADAPTERS for f in _src_files(_adapter_dir(a))]
    bad = []
    for p in files:
        if p == COMMON_SRC / "platform.py":
            continue
        tree = _parse(p)
        fns = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        has_twins = any(_is_npu_twin(f) for f in fns)
        for fn in fns:
            if not any(mod.split(".")[0] == "torch_npu" for _, mod in _imports(fn)):
                continue
            if not (_is_npu_twin(fn) or (fn.name.startswith("_") and has_twins)):
                bad.append(f"{p.relative_to(ROOT)}:{fn.lineno}: {fn.name} imports torch_npu outside an NPU twin")
    assert not bad, "\n".join(bad)


def test_every_environment_variable_is_in_the_serve_table():
    """Each ASCEND_ADAPTERS_* name the code reads or sets is a row of docs/serve.md's table."""
    import re

    code = [ROOT / "noxfile.py", ROOT / "conftest.py"]
    code += [
        p for d in ("common", "models", "testing") for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts
    ]
    names = set()
    for p in code:
        names |= set(re.findall(r"ASCEND_ADAPTERS_[A-Z0-9_]*[A-Z0-9]", p.read_text()))
    names.discard("ASCEND_ADAPTERS_FLAGS_TEST")  # test_flags.py's scratch variable
    rows = set(re.findall(r"^\| `(ASCEND_ADAPTERS_[A-Z0-9_]+)` \|", (ROOT / "docs" / "serve.md").read_text(), re.M))
    assert names, "no variables found: the scan is broken"
    assert not names - rows, f"missing from docs/serve.md's table: {sorted(names - rows)}"
    assert not rows - names, f"in docs/serve.md's table but read nowhere: {sorted(rows - names)}"


def test_common_has_the_rooms_the_doc_names():
    have = {p.name for p in COMMON_SRC.iterdir() if p.name != "__pycache__" and (p.suffix == ".py" or p.is_dir())}
    unexplained = have - COMMON_ROOMS
    assert not unexplained, f"common: {sorted(unexplained)} have no room in docs/architecture.md"
    missing = COMMON_ROOMS - have
    assert not missing, f"common lacks {sorted(missing)} (update COMMON_ROOMS and docs/architecture.md)"
    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = doc[doc.index("## The rooms of common") :].split("\n## ")[0]
    for room in COMMON_ROOMS - {"__init__.py"}:
        name = room.removesuffix(".py")
        assert f"`{name}`" in table, f"docs/architecture.md's table of common's rooms lacks `{name}`"


def _mentions_testing(tree: ast.AST) -> list[str]:
    found = [f"{line}: import {mod}" for line, mod in _imports(tree) if mod == TESTING or mod.startswith(TESTING + ".")]
    for node in ast.walk(tree):  # importlib.import_module("ascend_adapters.testing..."), entry lists
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(TESTING):
            found.append(f"{node.lineno}: {node.value!r}")
    return found


def test_nothing_a_user_runs_imports_the_test_layer():
    """common and the adapters (the gate, the CLI, the demo, every tiny.py included) never reach
    ascend_adapters.testing, at module level or inside a function."""
    files = _src_files(COMMON_SRC) + [f for a in ADAPTERS for f in _src_files(_adapter_dir(a))]
    bad = [f"{p.relative_to(ROOT)}:{use}" for p in files for use in _mentions_testing(_parse(p))]
    assert not bad, f"user code reaches the test layer ({TESTING}):\n" + "\n".join(bad)


def test_deepseek_v4_memory_is_config_arithmetic():
    """memory.py sizes state and weights from a config; the model imports it, never the reverse."""
    memory = _adapter_dir("deepseek_v4") / "memory.py"
    bad = [
        f"{line}: {mod}"
        for line, mod in _imports(_parse(memory))
        if mod.startswith("ascend_adapters.deepseek_v4.") and not mod.startswith("ascend_adapters.deepseek_v4.config")
    ]
    assert not bad, f"{memory.relative_to(ROOT)} imports more than the config:\n" + "\n".join(bad)


def _string_constants(path: Path) -> set[str]:
    return {n.value for n in ast.walk(_parse(path)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_every_node_id_the_noxfile_names_exists():
    """Each node id of noxfile.py's FAST_SERVED_GATES (`nox -s tests`) and CAPABILITY_GATES (`nox -s
    capability_gates`) names a test file (all of it) or a test function defined in it, once per tuple; a parametrized
    id's parameters are string constants of its folder's test modules. Read with ast: nothing imported or run
    (a renamed test would otherwise leave CI running a selection pytest cannot find)."""
    tuples = {}
    for node in _parse(ROOT / "noxfile.py").body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("FAST_SERVED_GATES", "CAPABILITY_GATES"):
                tuples[node.targets[0].id] = ast.literal_eval(node.value)
    assert set(tuples) == {"FAST_SERVED_GATES", "CAPABILITY_GATES"}, f"noxfile.py defines only {sorted(tuples)}"
    bad = []
    for name, node_ids in tuples.items():
        bad += [f"{name}: {n} named twice" for n in sorted({n for n in node_ids if node_ids.count(n) > 1})]
        for node_id in node_ids:
            file, _, test = node_id.partition("::")
            func, _, params = test.partition("[")
            path = ROOT / file
            if not test and path.is_file() and path.name.startswith("test_"):
                continue  # the whole file
            if not (path.is_file() and path.name.startswith("test_") and func.startswith("test_")):
                bad.append(f"{name}: {node_id}: no test file {file} or not a test function")
                continue
            tree = _parse(path)
            defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            if func not in defined:
                bad.append(f"{name}: {node_id}: {file} defines no {func}")
            elif params:
                constants = set().union(*(_string_constants(p) for p in path.parent.glob("*.py")))
                missing = [p for p in params.removesuffix("]").split("-") if p not in constants]
                bad += [f"{name}: {node_id}: no parameter {p!r} in {path.parent.relative_to(ROOT)}" for p in missing]
    assert not bad, "noxfile.py names tests that do not exist:\n" + "\n".join(bad)
