import pytest

from ascend_adapters.common import dispatch, platform
from ascend_adapters.common.platform import KernelPath


def test_portable_path_without_npu(monkeypatch):
    ok, why = platform.npu_available()
    assert not ok and why  # no NPU on these machines
    platform.kernel_path.cache_clear()
    try:
        assert platform.kernel_path() is KernelPath.PORTABLE
    finally:
        platform.kernel_path.cache_clear()


def test_force_portable_env(monkeypatch):
    monkeypatch.setattr(platform, "npu_available", lambda: (True, "pretend"))
    platform.kernel_path.cache_clear()
    try:
        assert platform.kernel_path() is KernelPath.NPU
        platform.kernel_path.cache_clear()
        monkeypatch.setenv(platform.FORCE_PORTABLE_ENV, "1")
        assert platform.kernel_path() is KernelPath.PORTABLE
    finally:
        platform.kernel_path.cache_clear()


def test_op_resolution_and_duplicates():
    @dispatch.portable("test.add_one")
    def add_one(x):
        return x + 1

    @dispatch.npu("test.add_one")
    def add_one_npu(x):
        return x + 100

    op = dispatch.op("test.add_one")
    assert op.resolve(KernelPath.PORTABLE)(1) == 2
    assert op.resolve(KernelPath.NPU)(1) == 101
    assert op(1) == 2  # this machine resolves to the portable path
    assert dispatch.registered_ops()["test.add_one"] == {"portable": True, "npu": True}

    with pytest.raises(ValueError, match="already has a portable implementation"):

        @dispatch.portable("test.add_one")
        def other(x):
            return x

    with pytest.raises(KeyError, match="unknown kernel op 'test.missing'"):
        dispatch.op("test.missing")


def test_npu_only_op_falls_back_with_error():
    @dispatch.npu("test.npu_only")
    def f(x):
        return x

    with pytest.raises(LookupError, match="no portable implementation"):
        dispatch.op("test.npu_only").resolve(KernelPath.PORTABLE)


def test_choose_takes_the_first_candidate_that_serves(monkeypatch):
    @dispatch.portable("test.chosen")
    def own(x):
        return x

    def engine(x):
        return -x

    tried = []

    def refuses():
        tried.append("a")
        return "no kernel for this shape"

    def serves():
        tried.append("b")
        return engine

    choice = dispatch.choose("test.chosen", [("a", refuses), ("b", serves)])
    assert choice.fn is engine and choice.source == "b" and tried == ["a", "b"]
    choice = dispatch.choose("test.chosen", [("a", refuses)])
    assert choice.fn is dispatch.op("test.chosen") and choice.source == "portable: no kernel for this shape"

    switch = "ASCEND_ADAPTERS_FLAGS_TEST"  # the scratch variable of test_flags.py
    monkeypatch.setenv(switch, "1")
    tried.clear()
    kept = dispatch.choose("test.chosen", [("b", serves)], switch=switch)
    assert kept.fn is dispatch.op("test.chosen") and tried == [] and kept.source == f"portable: {switch} is on"
    monkeypatch.setenv(switch, "0")
    assert dispatch.choose("test.chosen", [("b", serves)], switch=switch).source == "b"
