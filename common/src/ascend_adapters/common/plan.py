"""``ascend-adapters plan DIR --device 910B|910C --tp N [--pp N] --max-model-len L``: will it fit?

From ``DIR/config.json`` alone (no engine, no weights read), per rank of the largest pipeline stage:
the weights as served, the cache one request of ``L`` tokens reserves (KV cache, or RWKV-7's recurrent
state), the device memory vLLM may use, how many such requests fit, and what does not fit and why.

The per-model arithmetic lives in each adapter's ``memory.py`` (the same file name in every adapter),
behind one function, ``memory_plan(raw_config, request) -> ModelMemory``; this module finds the adapter
of DIR's architecture through the installed hooks (``status.adapter_architectures``: common never
imports an adapter by name), does the device arithmetic and prints the answer. Every number of the
device arithmetic is derived here, beside its source:

* device memory: 64 GiB per device on both, as vllm-ascend's deployment guides size them: "Atlas 800 A2
  (64G × 8)" (910B, eight devices a node) and "Atlas 800 A3 (64G × 16)" (910C: eight packages of two
  dies, each die one 64 GiB device) [docs/references.md#ascend-device-memory];
* the share vLLM takes: ``--gpu-memory-utilization``, 0.9 unless given: the lower of the values in use (vLLM
  0.32.0's ``CacheConfig`` default is 0.92, ``vllm/config/cache.py``; vllm-ascend's guides pass 0.95); pass
  the value you serve with;
* the block size: 128, vllm-ascend's default on an NPU (``platform.py``, ``check_and_update_config``);
* the layers of each pipeline stage: vLLM's ``get_pp_indices`` (``vllm/distributed/utils.py``), the
  remainder on the stages before the last;
* vocabularies padded to a multiple of 64 (``DEFAULT_VOCAB_PADDING_SIZE``,
  ``vllm/model_executor/layers/vocab_parallel_embedding.py``), then split across TP ranks.

The cache per request is what vLLM 0.32 reserves for one request of ``max_model_len`` tokens in its
start-up check and its "Maximum concurrency" line (``KVCacheSpec.max_memory_usage_bytes``): every
block up to ``L`` for a full cache, a sliding window's blocks plus one scheduler step for a sliding
one, one state block for RWKV-7. What is left after the weights is an upper bound for the caches: vLLM
also measures, at start-up, the activations of its profile run, its graphs and the communication
buffers, which no config says (``common/tests/test_plan.py`` compares the figures with vLLM's own on
the tiny checkpoints).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from ascend_adapters.common.policy import EIGHT_BIT_CACHE_DTYPES

GIB = 1 << 30

# docs/references.md#ascend-device-memory: vllm-ascend sizes both nodes in 64G devices
DEVICE_BYTES = {"910B": 64 * GIB, "910C": 64 * GIB}
DEVICES_PER_NODE = {"910B": 8, "910C": 16}  # "Atlas 800 A2 (64G x 8)", "Atlas 800 A3 (64G x 16)"
DEVICE_NOTE = {
    "910B": "Ascend 910B: one device, 64 GiB HBM (Atlas 800 A2: 8 per node)",
    "910C": "Ascend 910C: one die, 64 GiB HBM (a 910C package is 2 dies, each its own device; Atlas 800 A3: 16 per node)",
}
GPU_MEMORY_UTILIZATION = 0.9  # conservative: vLLM 0.32.0 defaults to 0.92, vllm-ascend's guides serve with 0.95
BLOCK_SIZE = 128  # vllm-ascend's default block size on an NPU
# the scheduler's token budget, which sliding caches reserve beyond their window: vLLM 0.32.0's `vllm serve`
# default on a device of >= 70 GiB (2048 below), arg_utils.py; vllm-ascend's guides pass 4096
MAX_NUM_BATCHED_TOKENS = 8192
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class PlanError(ValueError):
    """Bad input to ``plan``: the message is the one line printed."""


@dataclasses.dataclass(frozen=True)
class Request:
    """What is asked: the parallel layout, the context, and the serving settings that size caches."""

    tp: int
    pp: int
    max_model_len: int
    dtype: str  # served dtype (the checkpoint's torch_dtype unless --dtype)
    block_size: int = BLOCK_SIZE
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    # "auto": the served dtype; fp8 / fp8_e4m3 / int8_per_token_head: the 8-bit cache (kernels.kv8)
    kv_cache_dtype: str = "auto"

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclasses.dataclass
class StageMemory:
    """One pipeline stage, per tensor-parallel rank."""

    layers: tuple[int, int]  # [start, end) of the decoder layers
    weight_bytes: int  # parameters and buffers as served
    request_cache_bytes: int  # cache one request of max_model_len reserves, this stage's layers
    page_bytes: int  # one block id's bytes: one layer's page, or (DeepSeek-V4) every cache group's pages


@dataclasses.dataclass
class ModelMemory:
    arch: str
    cache_kind: str  # "KV cache" or "recurrent state"
    stages: list[StageMemory]
    notes: list[str] = dataclasses.field(default_factory=list)  # how the caches are counted
    exact_concurrency: bool = True  # False where vLLM's grouping may pad (DeepSeek-V4): an upper bound


# --- vLLM's own rules, restated (sources in the module docstring) ---------------------------------


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pad_vocab(vocab: int, pad: int = VOCAB_PADDING) -> int:
    return cdiv(vocab, pad) * pad


def pp_partitions(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """vLLM's ``get_pp_indices`` for every stage (no ``VLLM_PP_LAYER_PARTITION``)."""
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    out, start = [], 0
    for n in parts:
        out.append((start, start + n))
        start += n
    return out


def check_layout(req: Request, num_layers: int, splits: dict[str, int]) -> None:
    """Refuse, in one line, a layout vLLM would refuse: ``splits`` maps what TP splits to its count."""
    if req.tp < 1 or req.pp < 1:
        raise PlanError(f"--tp {req.tp} --pp {req.pp}: both must be at least 1")
    if req.max_model_len < 1:
        raise PlanError(f"--max-model-len {req.max_model_len}: must be at least 1")
    if req.pp > num_layers:
        raise PlanError(f"--pp {req.pp} exceeds the {num_layers} layers (every stage needs at least one)")
    for what, n in splits.items():
        if n % req.tp:
            raise PlanError(f"--tp {req.tp} does not divide the {n} {what} (tensor parallelism splits them)")


# --- the command ----------------------------------------------------------------------------------


def read_config(model_dir: str) -> dict:
    from ascend_adapters.common.status import ModelDirError, read_model_config

    try:
        return read_model_config(model_dir)
    except ModelDirError as exc:
        raise PlanError(str(exc)) from None


def adapter_memory_module(raw: dict, model_dir: str):
    """The ``memory`` module of the installed adapter serving DIR's architecture."""
    import importlib

    from ascend_adapters.common.status import adapter_architectures

    archs = raw.get("architectures")
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    if not archs:
        raise PlanError(f"{model_dir}/config.json names no architectures")
    ours = adapter_architectures()
    for arch in archs:
        if arch in ours:
            return arch, importlib.import_module(ours[arch] + ".memory")
    known = ", ".join(sorted(ours)) or "none installed"
    raise PlanError(
        f"{model_dir}/config.json: architecture {', '.join(archs)} is not one of the installed adapters' ({known})"
    )


def checkpoint_bytes(model_dir: str) -> tuple[int, int] | None:
    """(bytes of tensor data, files) of DIR's safetensors files, from their headers; None without any."""
    from ascend_adapters.common.admission.safetensors_header import read_tensors

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        try:
            tensors = read_tensors(f)
        except Exception as exc:
            raise PlanError(f"{f}: unreadable safetensors header ({exc})") from None
        total += sum(t.nbytes for t in tensors.values())
    return total, len(files)


def plan(model_dir: str, device: str, req: Request, *, memory_bytes: int | None = None, utilization: float) -> dict:
    """The plan as a dict (``format_plan`` prints it)."""
    if device not in DEVICE_BYTES:
        raise PlanError(f"--device {device}: one of {', '.join(DEVICE_BYTES)}")
    if not 0 < utilization <= 1:
        raise PlanError(f"--gpu-memory-utilization {utilization}: must be in (0, 1]")
    raw = read_config(model_dir)
    arch, memory = adapter_memory_module(raw, model_dir)
    if req.kv_cache_dtype != "auto" and not getattr(memory, "EIGHT_BIT_CACHE", False):
        raise PlanError(f"--kv-cache-dtype {req.kv_cache_dtype}: {arch}'s caches are stored in the served dtype only")
    try:
        mm = memory.memory_plan(raw, req)
    except PlanError as exc:
        if "config.json" in str(exc) or str(exc).startswith("--"):
            raise
        raise PlanError(f"{model_dir}/config.json: {exc}") from None
    except Exception as exc:  # a config field of the wrong type or shape: one line naming it, not a traceback
        raise PlanError(f"{model_dir}/config.json: {type(exc).__name__}: {exc}") from None
    total = memory_bytes if memory_bytes is not None else DEVICE_BYTES[device]
    usable = int(total * utilization)
    stages = []
    for s in mm.stages:
        free = usable - s.weight_bytes
        fit = max(0, free) // s.request_cache_bytes if s.request_cache_bytes else 0
        stages.append({**dataclasses.asdict(s), "free_bytes": free, "requests": fit})
    worst = min(stages, key=lambda s: s["requests"])
    heaviest = max(stages, key=lambda s: s["weight_bytes"])
    problems = []
    if heaviest["weight_bytes"] > usable:
        problems.append(
            f"the weights do not fit: {_size(heaviest['weight_bytes'])} per rank (stage of layers "
            f"{heaviest['layers'][0]}-{heaviest['layers'][1] - 1}) > {_size(usable)} usable; raise --tp or --pp"
        )
    elif worst["requests"] == 0:
        longest = _longest_fitting(memory, raw, req, usable)
        problems.append(
            f"one request of {req.max_model_len} tokens does not fit: its {mm.cache_kind} needs "
            f"{_size(worst['request_cache_bytes'])} per rank and {_size(max(0, worst['free_bytes']))} is left after "
            f"the weights (vLLM refuses to start); "
            + (f"--max-model-len {longest} fits" if longest else "no length fits: raise --tp or --pp")
        )
    checkpoint = checkpoint_bytes(model_dir)
    return {
        "model_dir": model_dir,
        "arch": arch,
        "device": device,
        "device_note": DEVICE_NOTE[device],
        "device_bytes": total,
        "gpu_memory_utilization": utilization,
        "usable_bytes": usable,
        "request": dataclasses.asdict(req),
        "devices": req.tp * req.pp,
        "nodes": cdiv(req.tp * req.pp, DEVICES_PER_NODE[device]),
        "cache_kind": mm.cache_kind,
        "stages": stages,
        "requests": worst["requests"],
        "exact_concurrency": mm.exact_concurrency,
        "notes": mm.notes,
        "checkpoint": None if checkpoint is None else {"bytes": checkpoint[0], "files": checkpoint[1]},
        "problems": problems,
    }


def _longest_fitting(memory, raw: dict, req: Request, usable: int) -> int:
    """The largest max_model_len (a multiple of the block size) whose one request fits every stage, or 0."""

    def fits(n: int) -> bool:
        mm = memory.memory_plan(raw, dataclasses.replace(req, max_model_len=n))
        return all(s.request_cache_bytes <= usable - s.weight_bytes for s in mm.stages)

    step = req.block_size
    if not fits(step):
        return 0
    lo, hi = 1, max(1, req.max_model_len // step)  # lo fits; hi x step does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step


def _size(n: int) -> str:
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def format_plan(p: dict) -> str:
    r = p["request"]
    layout = f"TP{r['tp']}" + (f" x PP{r['pp']}" if r["pp"] > 1 else "")
    lines = [
        f"{p['arch']} from {p['model_dir']}: {layout} on {p['devices']} device(s) ({p['nodes']} node(s)), "
        f"{r['dtype']}{'' if r['kv_cache_dtype'] == 'auto' else ', ' + r['kv_cache_dtype'] + ' KV cache'}, "
        f"max_model_len {r['max_model_len']}, block size {r['block_size']}",
        f"device: {p['device_note']}; vLLM uses {p['gpu_memory_utilization']} of {_size(p['device_bytes'])} = "
        f"{_size(p['usable_bytes'])}",
    ]
    if p["checkpoint"]:
        lines.append(
            f"checkpoint: {_size(p['checkpoint']['bytes'])} of tensors in {p['checkpoint']['files']} safetensors file(s)"
        )
    for i, s in enumerate(p["stages"]):
        head = f"stage {i} (layers {s['layers'][0]}-{s['layers'][1] - 1})" if len(p["stages"]) > 1 else "per rank"
        lines.append(
            f"{head}: weights {_size(s['weight_bytes'])}; {p['cache_kind']} per request of {r['max_model_len']} "
            f"tokens {_size(s['request_cache_bytes'])}; left for caches {_size(max(0, s['free_bytes']))}; "
            f"requests that fit: {s['requests']}"
        )
    bound = "" if p["exact_concurrency"] else "at most "
    lines.append(
        f"requests of {r['max_model_len']} tokens that fit at once: {bound}{p['requests']} (before the activations, "
        "graphs and communication buffers vLLM measures at start-up)"
    )
    lines.extend(f"note: {n}" for n in p["notes"])
    lines.extend(f"DOES NOT FIT: {x}" for x in p["problems"])
    return "\n".join(lines)


def add_parsers(sub) -> None:
    ap = sub.add_parser(
        "plan",
        help="memory plan of a checkpoint on 910B/910C: weights, cache per request, requests that fit",
        description=__doc__.split("\n\n")[0],
    )
    ap.add_argument("model_dir", metavar="DIR", help="checkpoint directory (config.json; safetensors optional)")
    ap.add_argument("--device", required=True, choices=sorted(DEVICE_BYTES), help="Ascend device")
    ap.add_argument("--tp", type=int, required=True, metavar="N", help="tensor-parallel size")
    ap.add_argument("--pp", type=int, default=1, metavar="N", help="pipeline-parallel size (default 1)")
    ap.add_argument("--max-model-len", type=int, required=True, metavar="L", help="context length per request")
    ap.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=None,
                    help="served dtype (default: config.json's torch_dtype / dtype, else bfloat16)")  # fmt: skip
    ap.add_argument("--kv-cache-dtype", choices=("auto", *EIGHT_BIT_CACHE_DTYPES), default="auto",
                    help="the cache as served: auto (the served dtype) or 8-bit (GLM-DSA, DeepSeek-V4)")  # fmt: skip
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE, metavar="B",
                    help=f"KV-cache block size (default {BLOCK_SIZE}, vllm-ascend's)")  # fmt: skip
    ap.add_argument("--max-num-batched-tokens", type=int, default=MAX_NUM_BATCHED_TOKENS, metavar="T",
                    help=f"scheduler token budget (default {MAX_NUM_BATCHED_TOKENS}); sizes sliding caches")  # fmt: skip
    ap.add_argument("--gpu-memory-utilization", type=float, default=GPU_MEMORY_UTILIZATION, metavar="F",
                    help=f"share of device memory vLLM uses (default {GPU_MEMORY_UTILIZATION}; vLLM 0.32 defaults to 0.92)")  # fmt: skip
    ap.add_argument("--device-memory-gib", type=float, default=None, metavar="G",
                    help="device memory in GiB, where the device reports other than 64")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.set_defaults(func=_run)


def served_dtype(raw: dict, asked: str | None) -> str:
    if asked:
        return asked
    for key in ("torch_dtype", "dtype"):
        value = raw.get(key)
        if value in DTYPE_BYTES:
            # vLLM's dtype "auto" serves a float32 checkpoint in the platform's preferred 16-bit type
            # (``_get_and_verify_dtype``, vllm/config/model.py: "Downcast for float32 models"); bfloat16 on NPU
            return "bfloat16" if value == "float32" else value
    return "bfloat16"


def _run(args) -> int:
    try:
        raw = read_config(args.model_dir)
        if args.block_size < 1 or args.max_num_batched_tokens < 1:
            raise PlanError("--block-size and --max-num-batched-tokens must be at least 1")
        req = Request(
            tp=args.tp,
            pp=args.pp,
            max_model_len=args.max_model_len,
            dtype=served_dtype(raw, args.dtype),
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        memory = None if args.device_memory_gib is None else int(args.device_memory_gib * GIB)
        if memory is not None and memory <= 0:
            raise PlanError(f"--device-memory-gib {args.device_memory_gib}: must be positive")
        p = plan(args.model_dir, args.device, req, memory_bytes=memory, utilization=args.gpu_memory_utilization)
    except PlanError as exc:
        print("ascend-adapters plan: " + " ".join(str(exc).split()), file=sys.stderr)  # one line, whatever the source
        return 2
    print(json.dumps(p, indent=2) if args.json else format_plan(p))
    return 1 if p["problems"] else 0
