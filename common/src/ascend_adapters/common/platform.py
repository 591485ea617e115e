"""Which kernel implementation serves a tensor: decided from the tensor's device.

An op's NPU implementation runs for tensors on an ``npu`` device; everything
else (CPU, any other device) takes the portable torch implementation. Whether
torch_npu happens to be importable does not matter: a CPU tensor in a process
that also sees an NPU still takes the portable path.

``ASCEND_ADAPTERS_FORCE_PORTABLE=1`` forces the portable path for NPU tensors too.

Tests only: with the torch_npu contract emulator installed as ``torch_npu``
(``ascend_adapters.testing.npu_emulator``), ``ASCEND_ADAPTERS_NPU_EMULATOR=1``
sends CPU tensors down the NPU implementation, so the torch_npu calls are
checked against their documented contracts on CPU. The variable is refused
when ``torch_npu`` is the real package.
"""

from __future__ import annotations

import enum
import functools
import logging

from ascend_adapters.common.flags import env_flag

logger = logging.getLogger("ascend_adapters")

FORCE_PORTABLE_ENV = "ASCEND_ADAPTERS_FORCE_PORTABLE"
EMULATOR_ENV = "ASCEND_ADAPTERS_NPU_EMULATOR"


class KernelPath(str, enum.Enum):
    NPU = "npu"
    PORTABLE = "portable"


def npu_available() -> tuple[bool, str]:
    """Return (available, reason) without raising."""
    try:
        import torch  # noqa: F401
        import torch_npu  # noqa: F401
    except Exception as exc:  # torch_npu missing, or present without CANN
        return False, f"torch_npu not importable ({type(exc).__name__}: {exc})"
    if getattr(torch_npu, "IS_CONTRACT_EMULATOR", False):
        return False, "torch_npu is the CPU contract emulator (tests), not an NPU"
    try:
        count = torch.npu.device_count()
    except Exception as exc:
        return False, f"torch.npu.device_count() failed ({exc})"
    if count < 1:
        return False, "torch_npu imported but no NPU device is visible"
    return True, f"{count} NPU device(s) visible"


@functools.lru_cache(maxsize=1)
def emulating() -> bool:
    """True when CPU tensors take the NPU implementations through the contract emulator (tests only)."""
    if not env_flag(EMULATOR_ENV):
        return False
    try:
        import torch_npu
    except ImportError as exc:
        raise RuntimeError(f"{EMULATOR_ENV} is set but no torch_npu emulator is installed ({exc})") from None
    if not getattr(torch_npu, "IS_CONTRACT_EMULATOR", False):
        raise RuntimeError(f"{EMULATOR_ENV} is set but torch_npu is the real package: unset it")
    logger.warning("ascend_adapters: NPU kernels run on CPU through the torch_npu CONTRACT EMULATOR (not an NPU)")
    return True


@functools.lru_cache(maxsize=8)
def path_for_device(device_type: str) -> KernelPath:
    """The implementation for tensors on ``device_type`` (``"npu"``, ``"cpu"``, ...)."""
    if env_flag(FORCE_PORTABLE_ENV):
        return KernelPath.PORTABLE
    if device_type == "npu" or (device_type == "cpu" and emulating()):
        return KernelPath.NPU
    return KernelPath.PORTABLE


def reset() -> None:
    """Forget cached decisions (tests that change the environment)."""
    emulating.cache_clear()
    path_for_device.cache_clear()
    kernel_path.cache_clear()


@functools.lru_cache(maxsize=1)
def cpu_isa() -> str:
    """The widest int8-relevant x86 instruction set this CPU offers, from /proc/cpuinfo's flags:
    ``AMX``, ``AVX-512 VNNI``, ``AVX-VNNI``, ``AVX-512``, ``AVX2``, or the machine name elsewhere.
    Named in bench records and the W8A8 path choice; nothing is decided from it alone."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    for flag, name in (
        ("amx_int8", "AMX"),
        ("avx512_vnni", "AVX-512 VNNI"),
        ("avx_vnni", "AVX-VNNI"),
        ("avx512f", "AVX-512"),
        ("avx2", "AVX2"),
    ):
        if flag in flags:
            return name
    return platform.machine() or "unknown"


@functools.lru_cache(maxsize=1)
def kernel_path() -> KernelPath:
    """For ``status``: the path this process's model tensors would take; logged once."""
    if env_flag(FORCE_PORTABLE_ENV):
        path, why = KernelPath.PORTABLE, f"{FORCE_PORTABLE_ENV} is set"
    else:
        ok, why = npu_available()
        path = KernelPath.NPU if ok else KernelPath.PORTABLE
        why = f"{why}; chosen per tensor device"
    logger.info("ascend_adapters kernel path: %s (%s)", path.value, why)
    return path
