"""Which device the kernels run on, decided once per process.

The NPU path is taken when torch_npu imports and reports at least one NPU.
``ASCEND_ADAPTERS_FORCE_PORTABLE=1`` forces the portable torch path even then.
"""

from __future__ import annotations

import enum
import functools
import logging

from ascend_adapters.common.flags import env_flag

logger = logging.getLogger("ascend_adapters")

FORCE_PORTABLE_ENV = "ASCEND_ADAPTERS_FORCE_PORTABLE"


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
    try:
        count = torch.npu.device_count()
    except Exception as exc:
        return False, f"torch.npu.device_count() failed ({exc})"
    if count < 1:
        return False, "torch_npu imported but no NPU device is visible"
    return True, f"{count} NPU device(s) visible"


@functools.lru_cache(maxsize=1)
def kernel_path() -> KernelPath:
    """The kernel path for this process; logged once."""
    if env_flag(FORCE_PORTABLE_ENV):
        path, why = KernelPath.PORTABLE, f"{FORCE_PORTABLE_ENV} is set"
    else:
        ok, why = npu_available()
        path = KernelPath.NPU if ok else KernelPath.PORTABLE
    logger.info("ascend_adapters kernel path: %s (%s)", path.value, why)
    return path
