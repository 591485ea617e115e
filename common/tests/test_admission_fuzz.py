"""Property-based fuzzing of admission: every mutation of a valid artifact is refused,
with an error naming the culprit, and never with an unhandled exception.

Mutations: truncate a shard, flip a byte in a header or in data, delete /
rename / add a file, swap two shards, add a symlink escaping the directory (or
replace a file by one pointing at an identical copy outside), corrupt the index
JSON, change a dtype in a header, remove a companion tensor (shard and index
rewritten consistently).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_admission_support import build_templates, copy_artifact, header_of, rewrite_without, shards_of

from ascend_adapters.common.admission import check_dir
from ascend_adapters.common.admission.render import render_dir
from ascend_adapters.common.admission.safetensors_header import DTYPE_SIZES

ARTIFACTS = ("float_single", "float_sharded", "modelslim_dynamic", "modelslim_static")
KINDS = (
    "truncate",
    "flip_header",
    "flip_data",
    "delete",
    "rename",
    "add",
    "swap",
    "symlink_escape",
    "corrupt_index",
    "dtype",
    "remove_companion",
)
# Mutations the structural checks must catch even without sha256.
STRUCTURAL = {"truncate", "delete", "rename", "add", "swap", "symlink_escape", "corrupt_index", "dtype",
              "remove_companion"}  # fmt: skip

NAME = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=12)


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    return build_templates(tmp_path_factory.mktemp("fuzz-templates"), ARTIFACTS)


def files_of(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def mutate(data, kind: str, d: Path, outside: Path) -> list[str] | None:
    """Apply one mutation to ``d``; returns the names an error must mention (None: not applicable)."""
    shards = shards_of(d)
    files = files_of(d)
    if kind == "truncate":
        shard = data.draw(st.sampled_from(shards), label="shard")
        size = (d / shard).stat().st_size
        os.truncate(d / shard, data.draw(st.integers(0, size - 1), label="keep"))
        return [shard]
    if kind in ("flip_header", "flip_data"):
        shard = data.draw(st.sampled_from(shards), label="shard")
        n, _ = header_of(d / shard)
        size = (d / shard).stat().st_size
        lo, hi = (0, 8 + n - 1) if kind == "flip_header" else (8 + n, size - 1)
        off = data.draw(st.integers(lo, hi), label="offset")
        xor = data.draw(st.integers(1, 255), label="xor")
        raw = bytearray((d / shard).read_bytes())
        raw[off] ^= xor
        (d / shard).write_bytes(bytes(raw))
        return [shard]
    if kind == "delete":
        victim = data.draw(st.sampled_from(files), label="file")
        (d / victim).unlink()
        return [victim]
    if kind == "rename":
        victim = data.draw(st.sampled_from(files), label="file")
        new = data.draw(NAME, label="new") + data.draw(st.sampled_from(["", ".json", ".safetensors"]), label="ext")
        if new in files:
            return None
        (d / victim).rename(d / new)
        return [victim, new]
    if kind == "add":
        new = data.draw(NAME, label="new") + data.draw(st.sampled_from(["", ".json", ".safetensors", ".py"]))
        if new in files:
            return None
        sub = data.draw(st.booleans(), label="in_subdir")
        rel = f"extra/{new}" if sub else new
        (d / rel).parent.mkdir(exist_ok=True)
        (d / rel).write_bytes(data.draw(st.binary(max_size=64), label="content"))
        return [rel]
    if kind == "swap":
        if len(shards) < 2:
            return None
        a, b = data.draw(st.lists(st.sampled_from(shards), min_size=2, max_size=2, unique=True), label="pair")
        tmp = d / ".swap-tmp"
        (d / a).rename(tmp)
        (d / b).rename(d / a)
        tmp.rename(d / b)
        return [a, b]
    if kind == "symlink_escape":
        if data.draw(st.booleans(), label="replace_existing"):
            victim = data.draw(st.sampled_from(files), label="file")
            target = outside / "copy-of-file"
            shutil.copy(d / victim, target)  # identical bytes, but outside the model directory
            (d / victim).unlink()
            (d / victim).symlink_to(target)
            return [victim]
        name = data.draw(NAME, label="link")
        if name in files:
            return None
        target = data.draw(st.sampled_from([outside, outside / "f", Path("/etc/hostname"), Path("..")]), label="to")
        (d / name).symlink_to(target)
        return [name]
    if kind == "corrupt_index":
        indexes = sorted(str(p.relative_to(d)) for p in d.glob("*.safetensors.index.json"))
        if not indexes:
            return None
        index = d / indexes[0]
        text = index.read_text()
        how = data.draw(st.sampled_from(["truncate", "retarget", "drop", "ghost", "total"]), label="how")
        if how == "truncate":
            index.write_text(text[: data.draw(st.integers(0, len(text) - 1), label="keep")])
        else:
            obj = json.loads(text)
            names = sorted(obj["weight_map"])
            name = data.draw(st.sampled_from(names), label="tensor")
            if how == "retarget":
                obj["weight_map"][name] = data.draw(st.sampled_from([*shards, "nowhere.safetensors"]), label="to")
                if obj["weight_map"][name] == json.loads(text)["weight_map"][name]:
                    return None
            elif how == "drop":
                del obj["weight_map"][name]
            elif how == "ghost":
                obj["weight_map"]["ghost." + name] = obj["weight_map"][name]
            else:
                obj["metadata"]["total_size"] += data.draw(st.integers(1, 1000), label="delta")
            index.write_text(json.dumps(obj))
        return [indexes[0]]
    if kind == "dtype":
        shard = data.draw(st.sampled_from(shards), label="shard")
        n, header = header_of(d / shard)
        names = sorted(k for k in header if k != "__metadata__")
        name = data.draw(st.sampled_from(names), label="tensor")
        new = data.draw(st.sampled_from(sorted(set(DTYPE_SIZES) - {header[name]["dtype"]} | {"F4", "Q8"})))
        payload = (d / shard).read_bytes()[8 + n :]
        header[name]["dtype"] = new
        raw = json.dumps(header).encode()
        (d / shard).write_bytes(struct.pack("<Q", len(raw)) + raw + payload)
        return [shard]
    if kind == "remove_companion":
        desc_path = d / "quant_model_description.json"
        if not desc_path.exists():
            return None
        desc = json.loads(desc_path.read_text())
        comps = sorted(k for k in desc if k.rpartition(".")[2] in {"weight_scale", "weight_offset", "input_scale",
                                                                       "input_offset", "deq_scale", "quant_bias"})  # fmt: skip
        name = data.draw(st.sampled_from(comps), label="companion")
        rewrite_without(d, name)
        return [name]
    raise AssertionError(kind)


def named(report, culprit: str) -> bool:
    return any(culprit in p.where or culprit in p.message for p in report.errors)


# Each kind must have been applied (not merely drawn) at least this often: an inapplicable draw
# (swap on a one-shard artifact, remove_companion on a float one, a name that already exists) is
# discarded with ``assume`` and counted apart, never counted as a refused mutation.
MIN_APPLIED_PER_KIND = 3


def test_every_mutation_is_refused_naming_the_culprit(templates):
    applied, inapplicable = Counter(), Counter()

    @settings(
        max_examples=int(os.environ.get("ADMISSION_FUZZ_EXAMPLES", "160")),
        # a fixed example sequence: whether every kind got its MIN_APPLIED_PER_KIND must not depend on luck
        derandomize=True,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(data=st.data())
    def run(data):
        name = data.draw(st.sampled_from(ARTIFACTS), label="artifact")
        kind = data.draw(st.sampled_from(KINDS), label="kind")
        src, manifest = templates[name]
        with tempfile.TemporaryDirectory() as tmp:
            d = copy_artifact(src, Path(tmp) / "model")
            outside = Path(tmp) / "outside"
            outside.mkdir()
            culprits = mutate(data, kind, d, outside)
            if culprits is None:
                inapplicable[kind] += 1
                assume(False)
            report = check_dir(d, manifest, progress=False)
            assert not report.ok, f"{kind} on {name} was accepted"
            assert not [p for p in report.errors if p.code == "internal"], report.format()
            for c in culprits:
                assert named(report, c), f"{kind} on {name}: no error names {c!r}\n{report.format()}"
            if kind in STRUCTURAL:
                quick = check_dir(d, manifest, verify_hashes=False, progress=False)
                assert not quick.ok, f"{kind} on {name} passed the structural checks\n{quick.format()}"
                assert not [p for p in quick.errors if p.code == "internal"], quick.format()
                assert any(named(quick, c) for c in culprits), quick.format()
            render_dir(str(d))  # the summary never crashes either
            applied[kind] += 1

    run()
    print(f"applied per kind: {dict(applied)}; inapplicable draws (discarded): {dict(inapplicable)}")
    short = {k: applied[k] for k in KINDS if applied[k] < MIN_APPLIED_PER_KIND}
    assert not short, f"mutation kinds applied fewer than {MIN_APPLIED_PER_KIND} times: {short}"
