"""Reading and adjusting pass-through ``vllm serve`` arguments (no vLLM import)."""

from __future__ import annotations

import json
from collections.abc import Sequence

PORT = ("--port",)
HOST = ("--host",)
LOAD_FORMAT = ("--load-format",)
HF_OVERRIDES = ("--hf-overrides",)
SERVED_NAME = ("--served-model-name",)
CHAT_TEMPLATE = ("--chat-template",)
PARALLEL = {
    "tensor_parallel_size": ("--tensor-parallel-size", "-tp"),
    "pipeline_parallel_size": ("--pipeline-parallel-size", "-pp"),
    "data_parallel_size": ("--data-parallel-size", "-dp"),
    "enable_expert_parallel": ("--enable-expert-parallel",),
}


def option_value(args: Sequence[str], names: Sequence[str]) -> str | None:
    """Value of the last ``--name VALUE`` / ``--name=VALUE`` in ``args`` (argparse: last one wins)."""
    found = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                found = args[i + 1]
            elif arg.startswith(name + "="):
                found = arg.split("=", 1)[1]
    return found


def has_flag(args: Sequence[str], names: Sequence[str]) -> bool:
    return any(a in names or any(a.startswith(n + "=") for n in names) for a in args)


def without_option(args: Sequence[str], names: Sequence[str]) -> list[str]:
    """``args`` minus every ``--name VALUE`` / ``--name=VALUE``."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in names:
            skip = True
            continue
        if any(arg.startswith(n + "=") for n in names):
            continue
        out.append(arg)
    return out


def hf_overrides(args: Sequence[str]) -> dict:
    """The JSON of ``--hf-overrides`` (empty dict when absent); ValueError when it is not a JSON object."""
    raw = option_value(args, HF_OVERRIDES)
    if raw is None:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--hf-overrides is not valid JSON ({exc}): {raw!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--hf-overrides must be a JSON object, got {raw!r}")
    return value


def with_architecture(args: Sequence[str], architecture: str) -> list[str]:
    """``args`` with ``--hf-overrides`` selecting ``architecture`` (other overrides kept)."""
    overrides = hf_overrides(args)
    overrides["architectures"] = [architecture]
    return [*without_option(args, HF_OVERRIDES), "--hf-overrides", json.dumps(overrides, separators=(",", ":"))]


def parallel_settings(args: Sequence[str]) -> dict:
    out: dict = {}
    for key, names in PARALLEL.items():
        if key == "enable_expert_parallel":
            out[key] = has_flag(args, names)
        else:
            value = option_value(args, names)
            out[key] = int(value) if value and value.isdigit() else (value or 1)
    return out
