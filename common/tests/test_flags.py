"""common.flags: one vocabulary for every ASCEND_ADAPTERS_* variable, and common's readers use it."""

from __future__ import annotations

import pytest

from ascend_adapters.common import flags
from ascend_adapters.common.flags import FlagError, env_choice, env_flag

VAR = "ASCEND_ADAPTERS_FLAGS_TEST"
TRUE_WORDS = ["1", "true", "yes", "on", " ON ", "True", "YES"]
FALSE_WORDS = ["0", "false", "no", "off", " Off ", "FALSE", "No"]


@pytest.mark.parametrize("word", TRUE_WORDS)
def test_flag_truthy(monkeypatch, word):
    monkeypatch.setenv(VAR, word)
    assert env_flag(VAR) is True
    assert env_flag(VAR, default=True) is True


@pytest.mark.parametrize("word", FALSE_WORDS)
def test_flag_falsy(monkeypatch, word):
    monkeypatch.setenv(VAR, word)
    assert env_flag(VAR) is False
    assert env_flag(VAR, default=True) is False


@pytest.mark.parametrize("value", [None, "", "   "])
def test_flag_unset_or_empty_is_default(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, value)
    assert env_flag(VAR) is False
    assert env_flag(VAR, default=True) is True


@pytest.mark.parametrize("value", ["2", "maybe", "auto", "enable", "y"])
def test_flag_other_words_name_the_variable(monkeypatch, value):
    monkeypatch.setenv(VAR, value)
    with pytest.raises(FlagError) as err:
        env_flag(VAR)
    assert f"{VAR}={value!r}" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_choice_vocabulary(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    assert env_choice(VAR) == "auto"
    assert env_choice(VAR, default="off") == "off"
    for word in TRUE_WORDS:
        monkeypatch.setenv(VAR, word)
        assert env_choice(VAR) == "on"
    for word in FALSE_WORDS:
        monkeypatch.setenv(VAR, word)
        assert env_choice(VAR) == "off"
    monkeypatch.setenv(VAR, " AUTO ")
    assert env_choice(VAR) == "auto"
    monkeypatch.setenv(VAR, "Force")
    assert env_choice(VAR, extra=("force",)) == "force"


def test_choice_error_names_variable_and_words(monkeypatch):
    monkeypatch.setenv(VAR, "force")
    with pytest.raises(FlagError) as err:
        env_choice(VAR)  # "force" is not in this setting's vocabulary
    assert f"{VAR}='force'" in str(err.value) and "auto, on, off" in str(err.value)
    with pytest.raises(FlagError, match="auto, on, off, force"):
        monkeypatch.setenv(VAR, "sometimes")
        env_choice(VAR, extra=("force",))


def test_vocabulary_is_one_set():
    assert flags.TRUTHY == {"1", "true", "yes", "on"}
    assert flags.FALSY == {"0", "false", "no", "off"}
    assert not flags.TRUTHY & flags.FALSY


def test_force_portable_reads_the_vocabulary(monkeypatch):
    from ascend_adapters.common import platform

    monkeypatch.setattr(platform, "npu_available", lambda: (True, "pretend"))
    try:
        for word, expected in (("off", platform.KernelPath.NPU), ("yes", platform.KernelPath.PORTABLE)):
            monkeypatch.setenv(platform.FORCE_PORTABLE_ENV, word)
            platform.kernel_path.cache_clear()
            assert platform.kernel_path() is expected
        monkeypatch.setenv(platform.FORCE_PORTABLE_ENV, "portable")  # was silently "not forced"
        platform.kernel_path.cache_clear()
        with pytest.raises(FlagError, match=platform.FORCE_PORTABLE_ENV):
            platform.kernel_path()
    finally:
        platform.kernel_path.cache_clear()


def test_force_portable_means_the_kernel_path_only(monkeypatch):
    """ASCEND_ADAPTERS_FORCE_PORTABLE has one meaning: common's dispatch path. DeepSeek-V4's mHC ops
    have their own switch (ASCEND_ADAPTERS_DEEPSEEK_V4_PORTABLE_MHC); who serves an architecture is
    ASCEND_ADAPTERS_<MODEL> (test_native_first.py)."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig, set_current_vllm_config

    mhc = pytest.importorskip("ascend_adapters.deepseek_v4.mhc")
    config = SimpleNamespace(hc_mult=4, hidden_size=64, hc_sinkhorn_iters=3, hc_eps=1e-6, rms_norm_eps=1e-6)
    reason = f"portable: {mhc.PORTABLE_MHC_ENV} is on"
    with set_current_vllm_config(VllmConfig()):  # vLLM's mHC ops are CustomOps: built under a config
        _check_mhc_switches(monkeypatch, mhc, config, reason)


def _check_mhc_switches(monkeypatch, mhc, config, reason):
    import torch

    try:
        monkeypatch.setenv("ASCEND_ADAPTERS_FORCE_PORTABLE", "on")
        monkeypatch.delenv(mhc.PORTABLE_MHC_ENV, raising=False)
        mhc._select.cache_clear()
        sources = mhc.hc_ops(config, torch.bfloat16).source
        assert set(sources) == {"pre", "post", "head"}
        assert not any("FORCE_PORTABLE" in s or s == reason for s in sources.values()), sources

        monkeypatch.delenv("ASCEND_ADAPTERS_FORCE_PORTABLE")
        monkeypatch.setenv(mhc.PORTABLE_MHC_ENV, "on")
        mhc._select.cache_clear()
        assert mhc.hc_ops(config, torch.bfloat16).source == dict.fromkeys(("pre", "post", "head"), reason)

        monkeypatch.setenv(mhc.PORTABLE_MHC_ENV, "portable")  # a switch: on/off words only
        mhc._select.cache_clear()
        with pytest.raises(FlagError, match=mhc.PORTABLE_MHC_ENV):
            mhc.hc_ops(config, torch.bfloat16)
    finally:
        mhc._select.cache_clear()


def test_modelslim_auto_reads_the_vocabulary(monkeypatch):
    from ascend_adapters.common.quant import detect

    monkeypatch.delenv(detect.AUTO_ENV, raising=False)
    assert detect.auto_enabled()
    monkeypatch.setenv(detect.AUTO_ENV, "no")
    assert not detect.auto_enabled()
    monkeypatch.setenv(detect.AUTO_ENV, "nein")  # was silently "on"
    with pytest.raises(FlagError, match=detect.AUTO_ENV):
        detect.auto_enabled()


def test_probe_switch_reads_the_vocabulary(monkeypatch):
    from ascend_adapters.testing import probe

    monkeypatch.setenv(probe.PROBE_ENV, "enabled")  # was silently "off"
    with pytest.raises(FlagError, match=probe.PROBE_ENV):
        probe.register()
    monkeypatch.setenv(probe.PROBE_ENV, "off")
    probe.register()  # registers nothing, imports no vLLM
