"""Native first and the ModelSlim hand-off, decided against a platform plugin installed for the test.

A test-only distribution (``fake_npu``) is written into a temporary folder on ``PYTHONPATH`` of a
subprocess: a real ``vllm.platform_plugins`` entry (vLLM activates it as the current platform, a
subclass of vLLM's CPU platform) and a ``vllm.general_plugins`` hook that registers
``GlmMoeDsaForCausalLM`` and ``DeepseekV4ForCausalLM`` the way vllm-ascend's
``vllm_ascend/models/__init__.py`` does, plus a ``quantization/modelslim_config.py`` naming the
description file and defining ``override_quantization_method`` as vllm-ascend's does. Nothing in vLLM
is mocked: vLLM discovers the plugin through its entry points.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

GLM = "GlmMoeDsaForCausalLM"
DSV4 = "DeepseekV4ForCausalLM"
FAKE_TARGET = "fake_npu.models.fake:FakeModel"


def _write_fake_platform(root: Path, *, registers_models: bool, modelslim: bool) -> Path:
    site = root / "site"
    dist = site / "fake_npu_platform-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-npu-platform\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.platform_plugins]\nfake_npu = fake_npu:register\n\n"
        "[vllm.general_plugins]\nfake_npu_model = fake_npu:register_model\n"
    )
    pkg = site / "fake_npu"
    (pkg / "models").mkdir(parents=True)
    (pkg / "quantization").mkdir()
    (pkg / "__init__.py").write_text(
        "def register():\n    return 'fake_npu.platform.FakeNpuPlatform'\n\n\n"
        "def register_model():\n    from .models import register_model\n\n    register_model()\n"
    )
    (pkg / "platform.py").write_text(
        "from vllm.platforms.cpu import CpuPlatform\n\n\nclass FakeNpuPlatform(CpuPlatform):\n    pass\n"
    )
    body = (
        f'    ModelRegistry.register_model("{DSV4}", "{FAKE_TARGET}")\n'
        f'    ModelRegistry.register_model(\n        "{GLM}", "{FAKE_TARGET}"\n    )\n'
        if registers_models
        else '    ModelRegistry.register_model("SomethingElseForCausalLM", "fake_npu.models.fake:FakeModel")\n'
    )
    (pkg / "models" / "__init__.py").write_text(f"from vllm import ModelRegistry\n\n\ndef register_model():\n{body}")
    (pkg / "models" / "fake.py").write_text("class FakeModel:\n    pass\n")
    (pkg / "quantization" / "__init__.py").write_text("")
    if modelslim:
        (pkg / "quantization" / "modelslim_config.py").write_text(
            'MODELSLIM_CONFIG_FILENAME = "quant_model_description.json"\n\n\n'
            "class AscendModelSlimConfig:\n"
            "    @classmethod\n"
            "    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):\n"
            "        return None\n"
        )
    return site


def _export(root: Path, arch: str) -> Path:
    d = root / f"export_{arch}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": "x"}))
    (d / "quant_model_description.json").write_text(json.dumps({"model_quant_type": "W8A8_DYNAMIC"}))
    return d


def _env(site: Path | None, **extra) -> dict:
    env = dict(os.environ)
    paths = [str(site)] if site else []
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    env.pop("VLLM_TARGET_DEVICE", None)
    for k in ("ASCEND_ADAPTERS_GLM_DSA", "ASCEND_ADAPTERS_DEEPSEEK_V4", "ASCEND_ADAPTERS_FORCE_PORTABLE"):
        env.pop(k, None)
    env.update(extra)
    return env


def _run(args, env, timeout=600):
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _status(site, model_dir, **extra) -> dict:
    cmd = [sys.executable, "-m", "ascend_adapters.common.cli", "status", "--json", "--model", str(model_dir)]
    return json.loads(_run(cmd, _env(site, **extra)))


def _serving(st: dict) -> dict:
    return {r["arch"]: r for r in st["serving"]}


ORDER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm.platforms import current_platform
    from ascend_adapters import glm_dsa, deepseek_v4
    import fake_npu
    if sys.argv[1] == "ours-first":
        glm_dsa.register(); deepseek_v4.register(); fake_npu.register_model()
    else:
        fake_npu.register_model(); glm_dsa.register(); deepseek_v4.register()
    from vllm import ModelRegistry
    from ascend_adapters.common.registry import decisions
    print(json.dumps({
        "platform": type(current_platform).__name__,
        "targets": {a: ModelRegistry.models[a].module_name + ":" + ModelRegistry.models[a].class_name
                    for a in ("GlmMoeDsaForCausalLM", "DeepseekV4ForCausalLM")},
        "serves": {a: d.serves for a, d in decisions().items()},
    }))
    """
)


@pytest.mark.parametrize("order", ["ours-first", "platform-first"])
def test_platform_that_serves_the_arch_keeps_it_whatever_the_order(tmp_path, order):
    site = _write_fake_platform(tmp_path, registers_models=True, modelslim=True)
    out = json.loads(_run([sys.executable, "-c", ORDER_SCRIPT, order], _env(site)).strip().splitlines()[-1])
    assert out["platform"] == "FakeNpuPlatform"
    assert out["serves"] == {GLM: "native", DSV4: "native"}
    assert out["targets"] == {GLM: FAKE_TARGET, DSV4: FAKE_TARGET}


def test_status_on_a_platform_that_serves_the_arch_and_reads_modelslim(tmp_path):
    site = _write_fake_platform(tmp_path, registers_models=True, modelslim=True)
    st = _status(site, _export(tmp_path, GLM))
    rows = _serving(st)
    assert rows[GLM]["serves"] == "native" and rows[GLM]["target"] == FAKE_TARGET
    assert "FakeNpuPlatform" in rows[GLM]["why"] or "platform plugin registered" in rows[GLM]["why"]
    assert rows[DSV4]["serves"] == "native"
    assert rows["Rwkv7ForCausalLM"]["serves"] == "adapter"  # no platform serves RWKV-7
    # The export goes to the platform's own ModelSlim method: nothing injected.
    assert st["quantization"]["method"] == "ascend", st["quantization"]
    # A stock architecture (no adapter of ours) also goes to the platform.
    assert _status(site, _export(tmp_path, "LlamaForCausalLM"))["quantization"]["method"] == "ascend"


def test_forcing_the_adapter_on_such_a_platform(tmp_path):
    site = _write_fake_platform(tmp_path, registers_models=True, modelslim=True)
    # Plugin order decides the registry when a user forces the adapter: the ours-first order shows the
    # decision itself; status reports what ended up registered either way.
    code = ORDER_SCRIPT
    env = _env(site, ASCEND_ADAPTERS_GLM_DSA="adapter", ASCEND_ADAPTERS_DEEPSEEK_V4="on")
    out = json.loads(_run([sys.executable, "-c", code, "platform-first"], env).strip().splitlines()[-1])
    assert out["serves"] == {GLM: "adapter", DSV4: "adapter"}
    assert out["targets"][GLM].startswith("ascend_adapters.glm_dsa.")
    assert out["targets"][DSV4].startswith("ascend_adapters.deepseek_v4.")


def test_force_portable_does_not_choose_who_serves(tmp_path):
    """ASCEND_ADAPTERS_FORCE_PORTABLE is the kernel path only (it once also forced the DeepSeek-V4
    adapter): on a platform that serves both architectures they stay the platform's."""
    site = _write_fake_platform(tmp_path, registers_models=True, modelslim=True)
    env = _env(site, ASCEND_ADAPTERS_FORCE_PORTABLE="on")
    out = json.loads(_run([sys.executable, "-c", ORDER_SCRIPT, "ours-first"], env).strip().splitlines()[-1])
    assert out["serves"] == {GLM: "native", DSV4: "native"}
    assert out["targets"] == {GLM: FAKE_TARGET, DSV4: FAKE_TARGET}


def test_older_platform_without_the_model_gets_the_adapter_and_modelslim(tmp_path):
    site = _write_fake_platform(tmp_path, registers_models=False, modelslim=True)
    st = _status(site, _export(tmp_path, GLM))
    rows = _serving(st)
    assert rows[GLM]["serves"] == "adapter" and rows[GLM]["target"].startswith("ascend_adapters.glm_dsa.")
    assert rows[DSV4]["serves"] == "adapter"
    # Our adapter serves the architecture, so our method serves its export even on a ModelSlim platform.
    assert st["quantization"]["method"] == "modelslim"
    assert "served by this project's adapter" in st["quantization"]["why"]


def test_cpu_registers_the_adapters_and_selects_modelslim(tmp_path):
    st = _status(None, _export(tmp_path, "LlamaForCausalLM"))
    rows = _serving(st)
    assert rows[GLM]["serves"] == "adapter" and rows[DSV4]["serves"] == "adapter"
    assert "CpuPlatform does not serve" in rows[GLM]["why"]
    assert st["quantization"]["method"] == "modelslim"
    assert "no ModelSlim support" in st["quantization"]["why"]
    # The old switch meanings: off -> the platform's class (vLLM's in-tree one here).
    st = _status(None, _export(tmp_path, GLM), ASCEND_ADAPTERS_GLM_DSA="off")
    assert _serving(st)[GLM]["serves"] == "native"


def test_vllm_ascend_source_agrees_with_our_detection():
    """Where a vllm-ascend snapshot is at hand (VLLM_ASCEND_SRC), check the names we key on are its own."""
    src = os.environ.get("VLLM_ASCEND_SRC")
    if not src:
        pytest.skip("set VLLM_ASCEND_SRC to a vllm-ascend checkout to compare against its source")
    import re

    from ascend_adapters.common.quant.description import DESCRIPTION_FILE
    from ascend_adapters.common.quant.detect import PLATFORM_MODELSLIM_MODULE
    from ascend_adapters.common.registry import PLATFORM_MODEL_MODULE

    pkg = Path(src) / "vllm_ascend"
    models = (pkg / PLATFORM_MODEL_MODULE).read_text()
    for arch in (GLM, DSV4):
        assert re.search(r"register_model\(\s*\"" + arch + r"\"", models), arch
    quant = (pkg / PLATFORM_MODELSLIM_MODULE).read_text()
    assert f'"{DESCRIPTION_FILE}"' in quant
    override = quant[quant.index("def override_quantization_method") :][:600]
    assert "if not quant_method" in override  # claims only an empty quant_method
