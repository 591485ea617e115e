"""Admission checks on valid artifacts and on one targeted defect per check (no vLLM)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from test_admission_support import (
    BUILDERS,
    build_templates,
    copy_artifact,
    header_of,
    rewrite_without,
    shards_of,
    tree_digest,
)

from ascend_adapters.common.admission import build_manifest, check_dir, dump_manifest, inspect_dir, load_manifest
from ascend_adapters.common.admission.report import Report
from ascend_adapters.common.cli import main as cli_main


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    return build_templates(tmp_path_factory.mktemp("admission-templates"))


@pytest.fixture
def artifact(templates, tmp_path, request):
    """A fresh copy of one template: (dir, manifest)."""
    name = getattr(request, "param", "float_single")
    src, manifest = templates[name]
    return copy_artifact(src, tmp_path / name), json.loads(json.dumps(manifest))


def codes(report: Report) -> set[str]:
    return {p.code for p in report.errors}


def assert_refused(report: Report, code: str, culprit: str) -> None:
    assert not report.ok, "accepted a defective artifact"
    hits = [p for p in report.errors if p.code == code and (culprit in p.where or culprit in p.message)]
    assert hits, f"expected [{code}] naming {culprit!r}, got:\n{report.format()}"


# -- valid artifacts -----------------------------------------------------------


@pytest.mark.parametrize("name", list(BUILDERS))
def test_valid_artifacts_pass(templates, name):
    d, manifest = templates[name]
    report = check_dir(d, manifest, progress=False)
    assert report.ok, report.format()
    assert report.stats["hashed"] and report.stats["tensors"] == len(manifest["tensors"])
    assert report.summary_line().startswith("OK ")


def test_manifest_contents_match_the_files(templates):
    d, manifest = templates["modelslim_dynamic"]
    import hashlib

    for f in manifest["files"]:
        data = (d / f["path"]).read_bytes()
        assert len(data) == f["size"] and hashlib.sha256(data).hexdigest() == f["sha256"]
    from safetensors import safe_open

    seen = {}
    for rel in shards_of(d):
        with safe_open(str(d / rel), "pt") as sf:
            for k in sf.keys():
                t = sf.get_slice(k)
                seen[k] = (rel, t.get_dtype(), list(t.get_shape()))
    declared = {t["name"]: (t["file"], t["dtype"], t["shape"]) for t in manifest["tensors"]}
    assert declared == seen  # the torch-free reader agrees with the safetensors library
    ms = manifest["modelslim"]
    assert ms["model_quant_type"] == "W8A8_DYNAMIC" and ms["version"] == "1.0.0"
    desc = json.loads((d / "quant_model_description.json").read_text())
    assert sum(ms["type_counts"].values()) == sum(1 for k in desc if k in seen)
    assert manifest["artifact"]["architectures"] == ["LlamaForCausalLM"]


def test_checks_do_not_import_torch(templates, tmp_path):
    d, manifest = templates["modelslim_static"]
    mpath = tmp_path / "m.json"
    dump_manifest(manifest, mpath)
    code = (
        "import sys\n"
        "from ascend_adapters.common.admission import check_dir, build_manifest\n"
        "from ascend_adapters.common.versions import installed_versions\n"
        f"r = check_dir({str(d)!r}, {str(mpath)!r}, progress=False)\n"
        f"m, r2 = build_manifest({str(d)!r}, progress=False)\n"
        "installed_versions()\n"
        "bad = [m for m in ('torch', 'vllm', 'transformers', 'safetensors', 'numpy') if m in sys.modules]\n"
        "print(r.ok, r2.ok, bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True True []"


# -- read-only -----------------------------------------------------------------


_WRITE_EVENTS = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.symlink", "os.link",
                 "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move"}  # fmt: skip
_AUDIT = {"active": None, "writes": []}


def _audit(event, args):
    root = _AUDIT["active"]
    if root is None:
        return
    if event == "open":
        path, mode, flags = (list(args) + [None, None])[:3]
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
        )
        if writes and str(path).startswith(root):
            _AUDIT["writes"].append((event, str(path)))
    elif event in _WRITE_EVENTS and any(str(a).startswith(root) for a in args):
        _AUDIT["writes"].append((event, args))


sys.addaudithook(_audit)


@pytest.mark.parametrize("artifact", ["modelslim_static"], indirect=True)
def test_read_only_tree_unchanged_and_read_only_copy_passes(artifact, tmp_path):
    d, manifest = artifact
    before = tree_digest(d)
    mpath = tmp_path / "manifest.json"
    _AUDIT.update(active=str(d), writes=[])
    try:
        assert cli_main(["manifest", str(d), "-o", str(mpath), "--no-progress"]) == 0
        assert cli_main(["check", str(d), "--manifest", str(mpath), "--no-progress"]) == 0
        assert cli_main(["render", str(d)]) == 0
        assert cli_main(["manifest", str(d), "-o", str(d / "inside.json")]) == 2
    finally:
        _AUDIT["active"] = None
    assert _AUDIT["writes"] == []  # no write-mode open, rename, chmod... under the model directory
    assert tree_digest(d) == before
    _AUDIT.update(active=str(tmp_path / "control"), writes=[])  # the audit hook does see writes
    (tmp_path / "control").mkdir()
    (tmp_path / "control" / "x").write_text("x")
    _AUDIT["active"] = None
    assert len(_AUDIT["writes"]) == 2
    # A read-only copy: every check still passes and nothing tries to write.
    ro = tmp_path / "ro"
    shutil.copytree(d, ro)
    subprocess.run(["chmod", "-R", "a-w", str(ro)], check=True)
    try:
        ro_before = tree_digest(ro)
        report = check_dir(ro, mpath, progress=False)
        assert report.ok, report.format()
        m2, r2 = build_manifest(ro, progress=False)
        assert m2 is not None and m2["artifact"]["id"] == manifest["artifact"]["id"], r2.format()
        assert tree_digest(ro) == ro_before
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(ro)], check=True)


def test_manifest_refuses_to_write_inside_model_dir(artifact, capsys):
    d, _ = artifact
    before = tree_digest(d)
    assert cli_main(["manifest", str(d), "-o", str(d / "manifest.json")]) == 2
    assert tree_digest(d) == before


# -- one defect per check ----------------------------------------------------------


def test_truncated_shard(artifact):
    d, m = artifact
    p = d / "model.safetensors"
    os.truncate(p, p.stat().st_size - 10)
    r = check_dir(d, m, progress=False)
    assert_refused(r, "st-truncated", "model.safetensors")
    assert_refused(r, "file-size", "model.safetensors")


def test_header_length_past_end(artifact):
    d, m = artifact
    with open(d / "model.safetensors", "r+b") as f:
        f.write(struct.pack("<Q", 10**7))
    assert_refused(check_dir(d, m, progress=False), "st-truncated", "model.safetensors")


def test_header_length_over_bound(artifact):
    d, m = artifact
    with open(d / "model.safetensors", "r+b") as f:
        f.write(struct.pack("<Q", 2**62))
    assert_refused(check_dir(d, m, progress=False), "st-header-size", "model.safetensors")


def _edit_header(path: Path, fn) -> None:
    n, header = header_of(path)
    data = path.read_bytes()[8 + n :]
    fn(header)
    raw = json.dumps(header).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_dtype_not_allowed(artifact):
    d, m = artifact
    _edit_header(d / "model.safetensors", lambda h: h["lm_head.weight"].update(dtype="F4"))
    assert_refused(check_dir(d, m, progress=False), "st-dtype", "lm_head.weight")


def test_dtype_changed_same_size(artifact):
    d, m = artifact
    _edit_header(d / "model.safetensors", lambda h: h["lm_head.weight"].update(dtype="I32"))
    r = check_dir(d, m, verify_hashes=False, progress=False)
    assert_refused(r, "tensor-meta", "lm_head.weight")


def test_offsets_inconsistent_with_shape(artifact):
    d, m = artifact
    _edit_header(d / "model.safetensors", lambda h: h["model.norm.weight"].update(shape=[64]))
    assert_refused(check_dir(d, m, progress=False), "st-offsets", "model.norm.weight")


def test_overlap_and_trailing_bytes(artifact):
    d, m = artifact

    def overlap(h):
        a, b = h["model.norm.weight"]["data_offsets"]
        h["model.norm.weight"]["data_offsets"] = [a - 4, b - 4]

    _edit_header(d / "model.safetensors", overlap)
    r = check_dir(d, m, progress=False)
    assert_refused(r, "st-overlap", "model.norm.weight")
    with open(d / "model.safetensors", "ab") as f:
        f.write(b"\0" * 8)
    _edit_header(d / "model.safetensors", lambda h: None)
    p = d / "model.safetensors"
    r = Report()
    from ascend_adapters.common.admission.safetensors_header import read_header

    read_header(p, r, "model.safetensors")
    assert {"st-overlap", "st-gap", "st-trailing"} & codes(r)


def test_trailing_bytes(artifact):
    d, m = artifact
    with open(d / "model.safetensors", "ab") as f:
        f.write(b"\0" * 16)
    assert_refused(check_dir(d, m, progress=False), "st-trailing", "model.safetensors")


def test_header_not_json_and_duplicate_keys(artifact):
    d, m = artifact
    p = d / "model.safetensors"
    n, _ = header_of(p)
    raw = bytearray(p.read_bytes())
    raw[8 + 1] = ord("#")
    p.write_bytes(bytes(raw))
    assert_refused(check_dir(d, m, progress=False), "st-header-json", "model.safetensors")
    from ascend_adapters.common.admission.safetensors_header import read_header

    dup = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    q = d.parent / "dup.safetensors"
    q.write_bytes(struct.pack("<Q", len(dup)) + dup + b"\0" * 4)
    r = Report()
    assert read_header(q, r, "dup.safetensors") is None
    assert_refused(r, "st-header-json", "duplicate key")


@pytest.mark.parametrize("artifact", ["float_sharded"], indirect=True)
def test_index_inconsistent(artifact):
    d, m = artifact
    index = d / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = sorted(data["weight_map"])[0]
    shards = sorted(set(data["weight_map"].values()))
    other = next(s for s in shards if s != data["weight_map"][name])
    data["weight_map"][name] = other
    index.write_text(json.dumps(data))
    r = check_dir(d, m, progress=False)
    assert_refused(r, "index-tensor-missing", name)
    assert_refused(r, "index-tensor-unlisted", name)
    data["weight_map"]["ghost.weight"] = "model-00009-of-00009.safetensors"
    data["metadata"]["total_size"] += 1
    index.write_text(json.dumps(data))
    r = inspect_and_report(d)
    assert_refused(r, "index-shard-missing", "model-00009-of-00009.safetensors")
    index.write_text("{not json")
    assert_refused(check_dir(d, m, progress=False), "index-json", "model.safetensors.index.json")


@pytest.mark.parametrize("artifact", ["float_sharded"], indirect=True)
def test_index_total_size_and_unlisted_shard(artifact):
    d, m = artifact
    index = d / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["metadata"]["total_size"] += 4
    index.write_text(json.dumps(data))
    assert_refused(inspect_and_report(d), "index-total-size", "model.safetensors.index.json")
    shutil.copy(d / shards_of(d)[0], d / "extra.safetensors")
    r = inspect_and_report(d)
    assert_refused(r, "index-shard-unlisted", "extra.safetensors")
    assert_refused(r, "tensor-duplicate", "extra.safetensors")


def inspect_and_report(d: Path, **kw) -> Report:
    r = Report()
    inspect_dir(d, r, **kw)
    return r


def test_file_set(artifact):
    d, m = artifact
    (d / "tokenizer.json").unlink()
    shutil.copy(d / "model.safetensors", d / "copy.safetensors")
    (d / "notes.txt").write_text("hi")
    r = check_dir(d, m, progress=False)
    assert_refused(r, "file-missing", "tokenizer.json")
    assert_refused(r, "file-undeclared", "copy.safetensors")
    assert_refused(r, "file-undeclared", "notes.txt")


def test_pickle_files_refused(artifact):
    d, m = artifact
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04")
    assert_refused(check_dir(d, m, progress=False), "pickle-file", "pytorch_model.bin")


def test_config_identity(artifact):
    d, m = artifact
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    cfg["model_type"] = "mistral"
    (d / "config.json").write_text(json.dumps(cfg))
    r = check_dir(d, m, progress=False)
    assert_refused(r, "config-identity", "config.json:architectures")
    assert_refused(r, "config-identity", "config.json:model_type")
    (d / "config.json").unlink()
    assert_refused(check_dir(d, m, progress=False), "config-missing", "config.json")


def test_path_safety(artifact, tmp_path):
    d, m = artifact
    outside = tmp_path / "outside.txt"
    outside.write_text("x")
    (d / "escape.json").symlink_to(outside)
    (d / "dangling").symlink_to(d / "nope")
    (d / "sub").mkdir()
    (d / "subdir-link").symlink_to(d / "sub")
    os.mkfifo(d / "fifo")
    (d / "inside-link.json").symlink_to(d / "config.json")
    r = check_dir(d, m, progress=False)
    assert_refused(r, "path-symlink-escape", "escape.json")
    assert_refused(r, "path-symlink-dangling", "dangling")
    assert_refused(r, "path-symlink-dir", "subdir-link")
    assert_refused(r, "path-special", "fifo")
    assert_refused(r, "file-undeclared", "inside-link.json")  # inside links are followed, then declared or not


def test_device_file_refused():
    if not os.path.exists("/dev/null"):
        pytest.skip("no /dev/null")
    from ascend_adapters.common.admission.tree import scan_tree

    r = Report()
    # Scan /dev itself for a character device (never opened: lstat only).
    files = scan_tree("/dev", r) if os.access("/dev", os.R_OK) else {}
    assert "null" not in files
    assert any(p.code == "path-special" and p.where == "null" for p in r.errors)


@pytest.mark.parametrize(
    "bad_path",
    ["/etc/passwd", "../model.safetensors", "a/../../b", "./config.json", "a//b", "C:\\x", ""],
)
def test_manifest_path_rules(artifact, bad_path):
    d, m = artifact
    m["files"][0]["path"] = bad_path
    r = check_dir(d, m, progress=False)
    assert not r.ok
    assert any(p.code in ("manifest-path-unsafe", "manifest-schema") and "files[0].path" in p.where for p in r.errors)


# -- manifest schema: closed at every level ----------------------------------------------


@pytest.mark.parametrize(
    "where",
    ["", "artifact", "files.0", "tensors.0", "software", "modelslim"],
)
def test_schema_unknown_and_missing_keys(templates, where):
    _, base = templates["modelslim_dynamic"]
    for mode in ("unknown", "missing"):
        m = json.loads(json.dumps(base))
        node = m
        for part in filter(None, where.split(".")):
            node = node[int(part)] if part.isdigit() else node[part]
        if mode == "unknown":
            node["surprise"] = 1
        else:
            node.pop(sorted(node)[0])
        r = Report()
        from ascend_adapters.common.admission import schema

        assert not schema.validate(m, r)
        assert any(("unknown key" if mode == "unknown" else "missing key") in p.message for p in r.errors), r.format()


def test_schema_field_types(templates, tmp_path):
    _, base = templates["float_single"]
    cases = {
        ("files", 0, "sha256"): "ABC",
        ("files", 0, "size"): -1,
        ("tensors", 0, "dtype"): "F4",
        ("tensors", 0, "shape"): [1, True],
        ("artifact", "id"): "md5:00",
        ("software", "vllm"): ">>0.1",
        ("version",): 2,
        ("format",): "other",
    }
    for path, value in cases.items():
        m = json.loads(json.dumps(base))
        node = m
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value
        r = Report()
        from ascend_adapters.common.admission import schema

        assert not schema.validate(m, r), path
        assert any(".".join(str(p) for p in path).replace(".0", "[0]") in e.where for e in r.errors), r.format()
    # Not JSON / duplicate keys in the manifest file itself.
    p = tmp_path / "m.json"
    p.write_text('{"format": 1, "format": 2}')
    r = Report()
    assert load_manifest(p, r) is None and any("duplicate" in e.message for e in r.errors)


def test_edited_manifest_detected(artifact):
    d, m = artifact
    m["files"][0]["sha256"] = "0" * 64
    r = check_dir(d, m, progress=False)
    assert_refused(r, "manifest-id", "artifact.id")
    assert_refused(r, "file-sha256", m["files"][0]["path"])


# -- ModelSlim description -------------------------------------------------------------


def _desc(d: Path) -> dict:
    return json.loads((d / "quant_model_description.json").read_text())


def _write_desc(d: Path, desc: dict) -> None:
    (d / "quant_model_description.json").write_text(json.dumps(desc))


@pytest.mark.parametrize("artifact", ["modelslim_dynamic"], indirect=True)
def test_description_version_and_types(artifact):
    d, m = artifact
    desc = _desc(d)
    desc["version"] = "9.9.9"
    desc["model_quant_type"] = "W4A8_DYNAMIC"
    desc["model.norm.weight"] = "W4A16"
    desc["mystery"] = {"a": 1}
    desc["kv_cache_type"] = "C8"
    _write_desc(d, desc)
    r = check_dir(d, m, progress=False)
    assert_refused(r, "ms-version", "version")
    assert_refused(r, "ms-model-quant-type", "model_quant_type")
    assert_refused(r, "ms-type", "model.norm.weight")
    assert_refused(r, "ms-description-key", "mystery")
    assert_refused(r, "ms-feature", "kv_cache_type")
    assert_refused(r, "ms-summary", "type_counts")


@pytest.mark.parametrize("artifact", ["modelslim_dynamic", "modelslim_static"], indirect=True)
def test_companion_removed(artifact):
    d, m = artifact
    desc = _desc(d)
    name = next(k for k in sorted(desc) if k.endswith((".weight_scale", ".deq_scale")))
    rewrite_without(d, name)
    r = inspect_and_report(d)  # structurally consistent shards + index: only the companion rule fires
    assert codes(r) == {"ms-companion-missing", "ms-missing-tensor"}, r.format()
    assert_refused(r, "ms-companion-missing", name)
    r = check_dir(d, m, progress=False)
    assert_refused(r, "tensor-missing", name)


@pytest.mark.parametrize("artifact", ["modelslim_static"], indirect=True)
def test_companion_dtype_and_shape(artifact):
    d, m = artifact
    shard = next(s for s in shards_of(d) if "model.layers.0.self_attn.q_proj.quant_bias" in header_of(d / s)[1])
    _edit_header(d / shard, lambda h: h["model.layers.0.self_attn.q_proj.quant_bias"].update(dtype="F32"))
    r = inspect_and_report(d)
    assert_refused(r, "ms-companion-dtype", "model.layers.0.self_attn.q_proj.quant_bias")

    def reshape(h):
        t = h["model.layers.0.self_attn.q_proj.quant_bias"]
        t.update(dtype="I32", shape=[t["shape"][0] // 2, 2])

    _edit_header(d / shard, reshape)
    assert_refused(inspect_and_report(d), "ms-companion-shape", "model.layers.0.self_attn.q_proj.quant_bias")


@pytest.mark.parametrize("artifact", ["modelslim_dynamic"], indirect=True)
def test_fused_shards_must_share_type_and_weight_dtype(artifact):
    d, m = artifact
    desc = _desc(d)
    desc["model.layers.1.self_attn.k_proj.weight"] = "W8A8"
    _write_desc(d, desc)
    r = inspect_and_report(d)
    assert_refused(r, "ms-fused-type", "model.layers.1.self_attn")
    assert_refused(r, "ms-companion-missing", "model.layers.1.self_attn.k_proj.input_scale")
    desc = _desc(d)
    desc["model.layers.1.self_attn.k_proj.weight"] = "W8A8_DYNAMIC"
    desc["model.embed_tokens.weight"] = "W8A8_DYNAMIC"
    _write_desc(d, desc)
    assert_refused(inspect_and_report(d), "ms-weight", "model.embed_tokens.weight")
    desc["model.embed_tokens.weight"] = "FLOAT"
    desc["model.layers.0.mlp.up_proj.weight"] = "FLOAT"
    _write_desc(d, desc)
    r = inspect_and_report(d)
    assert_refused(r, "ms-dtype", "model.layers.0.mlp.up_proj.weight")
    assert_refused(r, "ms-orphan-companion", "model.layers.0.mlp.up_proj.weight_scale")


@pytest.mark.parametrize("artifact", ["modelslim_dynamic"], indirect=True)
def test_undescribed_tensors_float_only_when_declared(artifact, tmp_path):
    d, _ = artifact
    desc = _desc(d)
    del desc["model.norm.weight"]  # like an MTP layer missing from the description
    _write_desc(d, desc)
    m, r = build_manifest(d, progress=False)
    assert m is None
    assert_refused(r, "ms-undescribed", "model.norm.weight")
    out = tmp_path / "m.json"
    assert cli_main(["manifest", str(d), "-o", str(out), "--undescribed-as-float", "model.norm.weight"]) == 0
    m = json.loads(out.read_text())
    assert m["modelslim"]["undescribed_as_float"] == ["model.norm.weight"]
    r = check_dir(d, m, progress=False)
    assert r.ok, r.format()
    assert any(p.code == "ms-undescribed" and p.where == "model.norm.weight" for p in r.notes)
    # A manifest that does not say so refuses the same directory.
    m["modelslim"]["undescribed_as_float"] = []
    assert_refused(check_dir(d, m, progress=False), "ms-undescribed", "model.norm.weight")


@pytest.mark.parametrize("artifact", ["modelslim_dynamic"], indirect=True)
def test_description_added_to_float_manifest_or_removed(artifact, templates):
    d, m = artifact
    (d / "quant_model_description.json").unlink()
    r = check_dir(d, m, progress=False)
    assert_refused(r, "ms-description-missing", "quant_model_description.json")
    fd, fm = templates["float_single"]
    f2 = copy_artifact(fd, d.parent / "f2")
    (f2 / "quant_model_description.json").write_text(json.dumps({"version": "1.0.0"}))
    assert_refused(check_dir(f2, fm, progress=False), "ms-unexpected", "quant_model_description.json")


# -- software ranges ---------------------------------------------------------------------


def test_software_ranges(artifact):
    d, m = artifact
    m["software"].update(vllm=">=0.32,<0.33", torch=">=99", torch_npu=">=2.5", cann=">=8.0")
    installed = {"vllm": "0.32.0+cpu", "torch": "2.13.0+cpu", "torch_npu": None, "transformers": "5.19.0",
                 "vllm_ascend": None, "cann": "8.0.RC3"}  # fmt: skip
    r = check_dir(d, m, verify_hashes=False, installed=installed)
    assert codes(r) == {"software-version"}, r.format()
    assert_refused(r, "software-version", "torch")
    assert any(p.code == "software-absent" and p.where == "torch_npu" for p in r.notes)
    installed["cann"] = "7.0.0"
    assert_refused(check_dir(d, m, verify_hashes=False, installed=installed), "software-version", "cann")
    m["software"]["torch"] = None
    installed["cann"] = "8.1.RC1"
    assert check_dir(d, m, verify_hashes=False, installed=installed).ok


def test_manifest_require_option(artifact, tmp_path):
    d, _ = artifact
    out = tmp_path / "m.json"
    rc = cli_main(["manifest", str(d), "-o", str(out), "--require", "vllm=>=0.32", "--require", "torch-npu=>=2.5"])
    assert rc == 0
    m = json.loads(out.read_text())
    assert m["software"]["vllm"] == ">=0.32" and m["software"]["torch_npu"] == ">=2.5"
    assert m["software"]["cann"] is None
    with pytest.raises(SystemExit):
        cli_main(["manifest", str(d), "-o", str(out), "--require", "numpy=>=1"])


# -- CLI ----------------------------------------------------------------------------------


def test_cli_check_output_and_exit_codes(artifact, tmp_path):
    d, m = artifact
    mpath = tmp_path / "m.json"
    dump_manifest(m, mpath)
    exe = Path(sys.executable).parent / "ascend-adapters"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "ascend_adapters.common.cli"]
    ok = subprocess.run([*cmd, "check", str(d), "--manifest", str(mpath)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert len(ok.stdout.strip().splitlines()) == 1 and ok.stdout.startswith("OK ")
    (d / "tokenizer.json").write_text("{}")
    os.truncate(d / "model.safetensors", 1000)
    bad = subprocess.run([*cmd, "check", str(d), "--manifest", str(mpath)], capture_output=True, text=True)
    assert bad.returncode == 1
    assert "tokenizer.json" in bad.stdout and "model.safetensors" in bad.stdout and "Traceback" not in bad.stderr
    js = subprocess.run([*cmd, "check", str(d), "--manifest", str(mpath), "--json"], capture_output=True, text=True)
    data = json.loads(js.stdout)
    assert data["ok"] is False and {"file-size", "st-truncated"} <= {p["code"] for p in data["problems"]}


@pytest.mark.parametrize("artifact", ["modelslim_static"], indirect=True)
def test_cli_render(artifact, capsys):
    d, _ = artifact
    assert cli_main(["render", str(d)]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "W8A8" in out and "quant_model_weights-00001-of-" in out
    assert cli_main(["render", str(d), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["modelslim"]["model_quant_type"] == "W8A8"
    assert sum(s["tensors"] for s in data["summary"]["shards"]) == data["summary"]["tensors"]


def test_cli_status(capsys):
    import importlib.metadata as md

    assert cli_main(["status", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    names = {p["name"] for p in st["general_plugins"]}
    assert names == {ep.name for ep in md.entry_points(group="vllm.general_plugins")}
    assert "ascend_adapters_common" in names
    assert st["kernel_path"] in ("npu", "portable")
    assert st["versions"]["transformers"]["version"] == md.version("transformers")
    assert cli_main(["status"]) == 0
    out = capsys.readouterr().out
    assert "kernel dispatch path" in out and "ascend_adapters.common.plugin:register" in out


def test_hash_progress_only_on_tty(templates, capsys):
    from ascend_adapters.common.admission.hashing import hash_files

    d, _ = templates["float_sharded"]
    rels = shards_of(d)
    quiet = hash_files(d, rels, jobs=2)  # stderr is captured: not a TTY
    assert capsys.readouterr().err == ""
    loud = hash_files(d, rels, jobs=2, progress=True)
    assert "sha256 [" in capsys.readouterr().err
    import hashlib

    assert quiet == loud == {r: hashlib.sha256((d / r).read_bytes()).hexdigest() for r in rels}


def test_unreadable_file_reported(artifact):
    if os.geteuid() == 0:
        pytest.skip("root reads files without read permission")
    d, m = artifact
    (d / "tokenizer.json").chmod(0)
    try:
        r = check_dir(d, m, progress=False)
        assert_refused(r, "file-unreadable", "tokenizer.json")
    finally:
        (d / "tokenizer.json").chmod(stat.S_IRUSR | stat.S_IWUSR)


# -- serve-time hook logic (in-process; the real `vllm serve` runs in test_admission_serve.py) ------


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["vllm", "serve", "/m", "--port", "1"], "/m"),
        (["vllm", "serve", "--port", "1", "--model", "/m"], "/m"),
        (["x.py", "--model=/m"], "/m"),
        (["vllm", "serve", "--port", "1"], None),
        (["vllm", "chat"], None),
        (["script.py", "serve"], None),
    ],
)
def test_model_dir_from_argv(argv, expected):
    from ascend_adapters.common.admission.hook import model_dir_from_argv

    assert model_dir_from_argv(argv) == expected


def test_model_dir_from_argv_options_first_and_config_file(templates, tmp_path):
    from ascend_adapters.common.admission.hook import model_dir_from_argv

    d, _ = templates["float_single"]
    d2, _ = templates["float_sharded"]
    assert model_dir_from_argv(["vllm", "serve", "--port", "1", str(d), "--dtype", "float32"]) == str(d)
    assert model_dir_from_argv(["vllm", "serve", "--enforce-eager", str(d), "--tokenizer", str(d2)]) is None
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {d}\nport: 8000\n")
    assert model_dir_from_argv(["vllm", "serve", "--config", str(cfg)]) == str(d)
    assert model_dir_from_argv(["vllm", "serve", f"--config={cfg}", "--port", "1"]) == str(d)


def test_hook_full_then_quick(templates, tmp_path, monkeypatch, capsys):
    from ascend_adapters.common.admission import hook

    d, manifest = templates["float_sharded"]
    mpath = tmp_path / "m.json"
    dump_manifest(manifest, mpath)
    monkeypatch.setattr(hook, "_admitted", None)
    monkeypatch.delenv(hook.ADMITTED_ENV, raising=False)
    monkeypatch.delenv(hook.MODEL_DIR_ENV, raising=False)
    monkeypatch.setenv(hook.MANIFEST_ENV, str(mpath))
    # API-server-like process: the model comes from `serve DIR`.
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", str(d), "--port", "1"])
    hook.admit_from_env()
    assert "sha256 verified" in capsys.readouterr().err
    marker = json.loads(os.environ[hook.ADMITTED_ENV])
    assert marker["model_dir"] == os.path.realpath(d)
    hook.admit_from_env()  # idempotent within a process: no second check
    assert capsys.readouterr().err == ""
    # A child process (argv without the model): takes the directory from the marker, re-checks structure only.
    monkeypatch.setattr(hook, "_admitted", None)
    monkeypatch.setattr(sys, "argv", ["python", "-m", "vllm.model_executor.models.registry"])
    hook.admit_from_env()
    assert "re-checked structure" in capsys.readouterr().err
    # The structure changed after the parent's check: the child refuses too.
    monkeypatch.setattr(hook, "_admitted", None)
    moved = copy_artifact(d, tmp_path / "moved")
    monkeypatch.setitem(os.environ, hook.ADMITTED_ENV, json.dumps({**marker, "model_dir": os.path.realpath(moved)}))
    (moved / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exc:
        hook.admit_from_env()
    assert exc.value.code == hook.EXIT_CODE
    assert "[file-size] config.json" in capsys.readouterr().err


def test_hook_refusals(templates, tmp_path, monkeypatch, capsys):
    from ascend_adapters.common.admission import hook

    d, manifest = templates["float_single"]
    mpath = tmp_path / "m.json"
    dump_manifest(manifest, mpath)
    monkeypatch.setattr(hook, "_admitted", None)
    monkeypatch.delenv(hook.ADMITTED_ENV, raising=False)
    monkeypatch.setenv(hook.MANIFEST_ENV, str(mpath))
    cases = {
        "model-dir-unknown": ["vllm", "serve", "--port", "1"],
        "not a local model directory": ["vllm", "serve", "org/name"],
    }
    for expected, argv in cases.items():
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as exc:
            hook.admit_from_env()
        assert exc.value.code == hook.EXIT_CODE and expected in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["vllm", "chat"])  # a client command loads no model
    hook.admit_from_env()
    monkeypatch.setenv(hook.MANIFEST_ENV, str(tmp_path / "absent.json"))
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", str(d)])
    with pytest.raises(SystemExit):
        hook.admit_from_env()
    assert "manifest-unreadable" in capsys.readouterr().err
    # Explicit directory wins over argv; a bad manifest file is refused with its field named.
    m = json.loads(json.dumps(manifest))
    m["software"]["vllm"] = ">=999"
    dump_manifest(m, mpath)
    monkeypatch.setenv(hook.MANIFEST_ENV, str(mpath))
    monkeypatch.setenv(hook.MODEL_DIR_ENV, str(d))
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "/elsewhere"])
    with pytest.raises(SystemExit):
        hook.admit_from_env()
    err = capsys.readouterr().err
    if __import__("ascend_adapters.common.versions").common.versions.installed_versions()["vllm"]:
        assert "[software-version] vllm" in err
    assert "[manifest-id]" not in err  # software ranges are not part of the content id


def test_plugin_register_is_free_when_disabled(monkeypatch):
    code = (
        "import os, sys\n"
        "os.environ.pop('ASCEND_ADAPTERS_MANIFEST', None)\n"
        "import types\n"  # quant's own registration (imports vLLM) is not what this test measures
        "sys.modules['ascend_adapters.common.quant'] = types.SimpleNamespace(register=lambda: None)\n"
        "from ascend_adapters.common.plugin import register\n"
        "register(); register()\n"
        "print([m for m in sys.modules if m.startswith('ascend_adapters.common.admission')])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_schema_duplicates_and_dangling_references(templates):
    from ascend_adapters.common.admission import schema

    _, base = templates["modelslim_dynamic"]
    m = json.loads(json.dumps(base))
    m["files"].append(dict(m["files"][0]))
    m["tensors"].append(dict(m["tensors"][0]))
    m["tensors"][1]["file"] = "elsewhere.safetensors"
    m["modelslim"]["description"] = "other.json"
    r = Report()
    assert not schema.validate(m, r)
    text = r.format()
    assert "listed more than once" in text and "tensors[1].file" in text and "modelslim.description" in text


def test_hook_without_hashing(templates, tmp_path, monkeypatch, capsys):
    """ASCEND_ADAPTERS_ADMISSION_HASH=0: structure only (a flipped data byte passes, a truncated shard does not)."""
    from ascend_adapters.common.admission import hook

    d, manifest = templates["float_single"]
    mpath = tmp_path / "m.json"
    dump_manifest(manifest, mpath)
    flipped = copy_artifact(d, tmp_path / "flipped")
    raw = bytearray((flipped / "model.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    (flipped / "model.safetensors").write_bytes(bytes(raw))
    for var, value in ((hook.MANIFEST_ENV, str(mpath)), (hook.HASH_ENV, "0")):
        monkeypatch.setenv(var, value)
    monkeypatch.delenv(hook.ADMITTED_ENV, raising=False)
    monkeypatch.delenv(hook.MODEL_DIR_ENV, raising=False)
    monkeypatch.setattr(hook, "_admitted", None)
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", str(flipped)])
    hook.admit_from_env()
    assert "sha256 NOT verified" in capsys.readouterr().err
    monkeypatch.setattr(hook, "_admitted", None)
    monkeypatch.delenv(hook.ADMITTED_ENV, raising=False)
    monkeypatch.setenv(hook.HASH_ENV, "1")
    with pytest.raises(SystemExit):
        hook.admit_from_env()
    assert "[file-sha256] model.safetensors" in capsys.readouterr().err
    # a value outside common.flags' vocabulary refuses (fail closed), naming the variable
    monkeypatch.setattr(hook, "_admitted", None)
    monkeypatch.delenv(hook.ADMITTED_ENV, raising=False)
    monkeypatch.setenv(hook.HASH_ENV, "skip")
    with pytest.raises(SystemExit) as exited:
        hook.admit_from_env()
    assert exited.value.code == hook.EXIT_CODE
    assert f"{hook.HASH_ENV}='skip'" in capsys.readouterr().err


def test_hook_prefers_engine_args_model_over_argv(templates, tmp_path, monkeypatch, capsys):
    from ascend_adapters.common.admission import hook

    d, manifest = templates["float_single"]
    mpath = tmp_path / "m.json"
    dump_manifest(manifest, mpath)
    monkeypatch.setenv(hook.MANIFEST_ENV, str(mpath))
    monkeypatch.delenv(hook.ADMITTED_ENV, raising=False)
    monkeypatch.delenv(hook.MODEL_DIR_ENV, raising=False)
    monkeypatch.setattr(hook, "_admitted", None)
    monkeypatch.setattr(sys, "argv", ["script.py", "--model", str(tmp_path / "unrelated")])

    class MyEngineArgs:  # stands in for vllm's EngineArgs.__post_init__ calling the plugins
        model = str(d)

        def __post_init__(self):
            hook.admit_from_env()

    MyEngineArgs().__post_init__()
    assert f"checking {os.path.realpath(d)}" in capsys.readouterr().err
