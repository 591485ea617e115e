"""The one checkpoint loader every adapter uses: vLLM's ``AutoWeightsLoader`` with the adapter's
``WeightsMapper``, plus the accounting vLLM does not do.

vLLM checks loaded names only for unquantized models, exempts layers it post-processes, and counts
a fused parameter (``wqkv_a`` from ``wq_a`` + ``wkv``; a ``FusedMoE`` ``w13_weight`` from every
expert's ``gate_proj`` + ``up_proj``) as loaded as soon as one shard of it is. A checkpoint lacking
one expert's ``down_proj`` or one half of a fused projection would then serve uninitialised memory.
``load_checkpoint`` refuses that: it watches every parameter's ``weight_loader`` while vLLM loads,
so it knows which shard of which expert each parameter received, and it knows which checkpoint
tensor each call came from. After loading it refuses, by name:

- a checkpoint tensor that no loader took and no skip rule drops (unknown);
- a parameter no tensor reached, a shard of a fused parameter, or one expert's projection (missing).

Skips are rules (pattern -> reason) turned into ``None`` rules of the mapper and logged with their
reason. ``guard_dtype`` is the one dtype check a parameter's loader gets.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ascend_adapters.common import compat

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint tensor the model does not own, or one it needs and the checkpoint lacks (named)."""


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# vLLM's fused-MoE shard ids: w13 parameters hold gate (w1) and up (w3), w2 parameters down (w2).
MOE_SHARDS = {"w13": ("w1", "w3"), "w2": ("w2",)}
PIPELINE_STAGE_REASON = "weights of a layer on another pipeline stage"


def skip_mapper(rules: dict[str, str]):
    """A ``WeightsMapper`` dropping every name a rule pattern (searched in the name) matches."""
    from vllm.model_executor.models.utils import WeightsMapper

    return WeightsMapper(orig_to_new_regex={re.compile(pattern): None for pattern in rules})


def guard_dtype(
    param: torch.Tensor,
    allowed: tuple[torch.dtype, ...],
    describe: Callable[[object, object], str],
    why: str,
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None,
    error: type[Exception] = CheckpointError,
) -> torch.Tensor:
    """Wrap ``param.weight_loader`` so a checkpoint tensor of another dtype is refused by name.

    ``describe(shard, expert)`` names the tensor (shard and expert are None where the loader call has
    none); ``why`` says what makes ``allowed`` the only dtypes; ``convert`` casts what is accepted.
    """
    inner = getattr(param, "weight_loader", None) or _default_loader()

    def loader(param, loaded_weight, *args, **kwargs):
        if loaded_weight.dtype not in allowed:
            shard, expert = _shard_and_expert(args, kwargs)
            raise error(
                f"{describe(shard, expert)}: checkpoint tensor has dtype {loaded_weight.dtype}, but {why}, "
                f"which needs {[str(d) for d in allowed]}"
            )
        if convert is not None:
            loaded_weight = convert(loaded_weight)
        return inner(param, loaded_weight, *args, **kwargs)

    param.weight_loader = loader
    return param


def load_stacked_or_expert(
    params: dict[str, torch.Tensor],
    name: str,
    tensor: torch.Tensor,
    *,
    stacked_params: Iterable[tuple[str, str, object]] = (),
    expert_mapping: Iterable[tuple[str, str, int, str]] = (),
    num_experts: int = 0,
) -> str:
    """Load one (mapped) checkpoint tensor the way vLLM's DeepSeek models do; returns the parameter name.

    ``stacked_params``: (fused parameter part, checkpoint shard part, shard id), as vLLM's
    ``stacked_params_mapping``. ``expert_mapping``: vLLM's fused-MoE expert mapping (per-expert names
    ``experts.E.<proj>``); transformers' stacked layout (``experts.gate_up_proj`` [E, 2I, H],
    ``experts.down_proj`` [E, H, I]) is split into the same per-expert calls. Anything else loads
    into the parameter (or persistent buffer) of that name through its ``weight_loader``.
    """
    if ".experts." in name:
        for param_part, weight_part, expert_id, shard_id in expert_mapping:
            if weight_part in name:
                target = name.replace(weight_part, param_part)
                param = _lookup(params, target)
                param.weight_loader(param, tensor, target, shard_id=shard_id, expert_id=expert_id)
                return target
        stacked = _STACKED_EXPERTS.search(name) if num_experts else None
        if stacked:
            return _load_stacked_experts(params, name, tensor, stacked, expert_mapping, num_experts)
    for param_part, shard_part, shard_id in stacked_params:
        if shard_part in name:
            target = name.replace(shard_part, param_part)
            param = _lookup(params, target)
            param.weight_loader(param, tensor, shard_id)
            return target
    param = _lookup(params, name)
    getattr(param, "weight_loader", _default_loader())(param, tensor)
    return name


def load_module_tensors(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    stacked_params: Iterable[tuple[str, str, object]] = (),
    expert_mapping: Iterable[tuple[str, str, int, str]] = (),
    num_experts: int = 0,
) -> set[str]:
    """A model's inner ``load_weights``: each (mapped) tensor into the module's parameters and persistent
    buffers through ``load_stacked_or_expert``; returns the names loaded."""
    tensors = {**dict(module.named_buffers()), **dict(module.named_parameters())}
    return {
        load_stacked_or_expert(
            tensors,
            name,
            tensor,
            stacked_params=stacked_params,
            expert_mapping=expert_mapping,
            num_experts=num_experts,
        )
        for name, tensor in weights
    }


def load_checkpoint(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    what: str,
    mapper=None,
    skips: dict[str, str] | None = None,
    stacked_params: Iterable[tuple[str, str, object]] = (),
    expert_mapping: Iterable[tuple[str, str, int, str]] = (),
    required_buffers: Callable[[str], bool] = lambda name: False,
    error: type[CheckpointError] = CheckpointError,
) -> set[str]:
    """Load ``weights`` into ``model`` with ``AutoWeightsLoader`` and refuse what does not add up.

    ``what`` names the model in messages ("DeepSeek-V4"); ``mapper`` renames checkpoint names to the
    model's; ``skips`` (pattern -> reason) drops tensors on purpose, logged per reason.
    ``stacked_params`` / ``expert_mapping`` (with the model's parameter names, as its inner
    ``load_weights`` uses them) name a missing shard or expert in checkpoint terms. Persistent buffers
    for which ``required_buffers(name)`` holds must be loaded too.
    """
    from vllm.model_executor.models.utils import AutoWeightsLoader

    skips = dict(skips or {})
    full_mapper = skip_mapper(skips) | mapper if mapper is not None else skip_mapper(skips)
    stream = _WatchedStream(weights, compat.weights_mapper_fn(full_mapper), skips, _pipeline_missing_prefixes(model))
    record = _LoadRecord(model, stream)
    try:
        with record.watching():
            loaded = AutoWeightsLoader(model).load_weights(stream, mapper=full_mapper)
            stream.close_current()
    except CheckpointError:
        raise
    except (AssertionError, ValueError, RuntimeError, KeyError, IndexError) as exc:
        if stream.current is None:
            raise
        raise error(f"{what} checkpoint tensor {stream.current} {stream.shape}: {_detail(exc)}") from exc
    if stream.unknown:
        name = stream.unknown[0]
        raise error(
            f"{what} checkpoint tensor {name}: the model has no such tensor and no skip rule drops it "
            f"({len(stream.unknown)} such: {stream.unknown[:6]})"
        )
    missing = record.missing(stacked_params, expert_mapping, required_buffers)
    if missing:
        raise error(
            f"{what} checkpoint lacks {len(missing)} tensor(s) the model needs: "
            f"{missing[:12]}{' ...' if len(missing) > 12 else ''}"
        )
    stream.log_skipped(what)
    model.skipped_weights = dict(stream.skipped)
    return loaded | record.loaded_names()


# -- internals -----------------------------------------------------------------------------------

_STACKED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)(\.weight)?$")


def _default_loader():
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    return default_weight_loader


class _NotOwned(ValueError):
    """Raised inside the loader; ``load_checkpoint`` names the checkpoint tensor it was loading."""


def _lookup(params: dict, target: str) -> torch.Tensor:
    if target not in params:
        raise _NotOwned(f"the model has no such tensor ({target}) and no skip rule drops it")
    return params[target]


def _load_stacked_experts(params, name, tensor, stacked, expert_mapping, num_experts) -> str:
    if tensor.dim() != 3 or tensor.shape[0] != num_experts:
        raise ValueError(f"shape {tuple(tensor.shape)}, expected [{num_experts}, ., .] (one slice per expert)")
    base = name[: stacked.start()]
    w13 = stacked.group(1) == "gate_up_proj"
    per_expert = {(e, s): p for p, w, e, s in expert_mapping}
    target = None
    for e in range(num_experts):
        if w13:
            half = tensor.shape[1] // 2
            parts = (("w1", tensor[e, :half]), ("w3", tensor[e, half:]))
        else:
            parts = (("w2", tensor[e]),)
        for shard_id, part in parts:
            target = f"{base}.{per_expert[(e, shard_id)]}weight"
            param = _lookup(params, target)
            param.weight_loader(param, part, target, shard_id=shard_id, expert_id=e)
    return target


def _shard_and_expert(args: tuple, kwargs: dict) -> tuple[object, object]:
    """(shard id, expert id) of a ``weight_loader`` call: linear loaders take ``(param, w, shard)``,
    fused-MoE ones ``(param, w, weight_name, shard_id, expert_id)``."""
    if len(args) >= 3:
        shard, expert = args[1], args[2]
    elif len(args) == 2:
        shard, expert = args[1], kwargs.get("expert_id")
    elif len(args) == 1 and "expert_id" not in kwargs and "shard_id" not in kwargs:
        shard, expert = args[0], None
    else:
        shard, expert = kwargs.get("shard_id"), kwargs.get("expert_id")
    return kwargs.get("loaded_shard_id", shard), expert


def _detail(exc: Exception, limit: int = 400) -> str:
    text = str(exc) or f"{type(exc).__name__} in vLLM's weight loader (shape or dtype does not fit)"
    return text if len(text) <= limit else text[:limit] + " ..."


def _pipeline_missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    from vllm.model_executor.models.utils import PPMissingLayer

    return tuple(f"{name}." for name, m in model.named_modules() if name and isinstance(m, PPMissingLayer))


class _WatchedStream:
    """The checkpoint stream as vLLM's loader consumes it (lazily, one tensor at a time): which tensor
    is being loaded, which were dropped by a skip rule, and which no loader took."""

    def __init__(self, weights, map_name, skips: dict[str, str], stage_missing: tuple[str, ...]):
        self._weights, self._map = weights, map_name
        self._rules = [(re.compile(p), reason) for p, reason in skips.items()]
        self._stage_missing = stage_missing
        self.current: str | None = None
        self.shape: tuple[int, ...] = ()
        self.calls = 0  # loader calls made for the current tensor
        self.seen: set[str] = set()
        self.skipped: dict[str, str] = {}
        self.unknown: list[str] = []

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._weights:
            self.close_current()
            self.current, self.shape, self.calls = name, tuple(tensor.shape), 0
            self.seen.add(name)
            mapped = self._map(name)
            if mapped is None:
                self.skipped[name] = next(
                    (reason for pattern, reason in self._rules if pattern.search(name)), "dropped by the mapper"
                )
            elif self._stage_missing and mapped.startswith(self._stage_missing):
                # not handed on: a model's own inner load_weights would look the name up and not find it
                self.skipped[name] = PIPELINE_STAGE_REASON
                continue
            yield name, tensor
        self.close_current()

    def close_current(self) -> None:
        if self.current is not None and self.current not in self.skipped and self.calls == 0:
            self.unknown.append(self.current)
        self.current = None

    def log_skipped(self, what: str) -> None:
        by_reason: dict[str, list[str]] = {}
        for name, reason in sorted(self.skipped.items()):
            by_reason.setdefault(reason, []).append(name)
        for reason, names in by_reason.items():
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            logger.info("%s: skipped %d checkpoint tensor(s) on purpose, %s: %s", what, len(names), reason, shown)


@dataclass
class _Received:
    calls: int = 0
    pieces: set = field(default_factory=set)  # (shard id, expert id) of each call


class _LoadRecord:
    """What every parameter (and persistent buffer) received while loading, through its ``weight_loader``."""

    def __init__(self, model: nn.Module, stream: _WatchedStream):
        self.model, self.stream = model, stream
        self.params = dict(model.named_parameters())
        self.buffers = {
            name: buf for name, buf in model.named_buffers() if _persistent(model, name) and name not in self.params
        }
        self.received: dict[str, _Received] = {}
        self._saved: dict[str, object] = {}

    def watching(self):
        record = self

        class _Ctx:
            def __enter__(self):
                for name, tensor in {**record.params, **record.buffers}.items():
                    record._wrap(name, tensor)

            def __exit__(self, *exc):
                for name, tensor in {**record.params, **record.buffers}.items():
                    saved = record._saved.get(name)
                    if saved is None:
                        del tensor.weight_loader
                    else:
                        tensor.weight_loader = saved
                return False

        return _Ctx()

    def _wrap(self, name: str, tensor: torch.Tensor) -> None:
        inner = getattr(tensor, "weight_loader", None)
        self._saved[name] = inner
        call = inner or _default_loader()
        received = self.received.setdefault(name, _Received())
        stream = self.stream

        def loader(param, loaded_weight, *args, **kwargs):
            result = call(param, loaded_weight, *args, **kwargs)
            received.calls += 1
            received.pieces.add(_shard_and_expert(args, kwargs))
            stream.calls += 1
            return result

        tensor.weight_loader = loader

    def loaded_names(self) -> set[str]:
        return {name for name, r in self.received.items() if r.calls}

    def missing(self, stacked_params, expert_mapping, required_buffers) -> list[str]:
        modules = dict(self.model.named_modules())
        missing: list[str] = []
        for name in self.params:
            got = self.received.get(name, _Received())
            if not got.calls:
                missing.append(name)
                continue
            module_name, _, attr = name.rpartition(".")
            for shard, expert in _expected_pieces(name, modules.get(module_name), attr, got.pieces, expert_mapping):
                missing.append(_piece_name(name, shard, expert, stacked_params, expert_mapping))
        missing += [n for n in self.buffers if required_buffers(n) and not self.received.get(n, _Received()).calls]
        return missing


def _persistent(model: nn.Module, name: str) -> bool:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return attr not in getattr(module, "_non_persistent_buffers_set", set())


def _expected_pieces(name: str, module, attr: str, pieces: set, expert_mapping) -> list[tuple[object, object]]:
    """The (shard, expert) pieces a parameter is assembled from that no call delivered."""
    shards = {s for s, _ in pieces}
    experts = {e for _, e in pieces}
    if experts != {None}:
        # every expert of the checkpoint, wherever expert parallelism places it (vLLM's loader is
        # called for all of them and keeps this rank's)
        want = {(s, e) for p, _, e, s in expert_mapping if p in name}
        if not want and module is not None and hasattr(module, "global_num_experts"):
            side = attr.split("_", 1)[0]
            want = {(s, e) for e in range(module.global_num_experts) for s in MOE_SHARDS.get(side, ())}
        return sorted(want - pieces, key=lambda p: (p[1], str(p[0])))
    if None in shards or module is None:
        return []  # loaded whole (a checkpoint that already stores the fused tensor)
    want = _module_shards(module)
    return [(s, None) for s in want if s not in shards]


def _module_shards(module) -> list[object]:
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if isinstance(module, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(module, MergedColumnParallelLinear):
        return list(range(len(module.output_sizes)))
    return []


def _piece_name(name: str, shard, expert, stacked_params, expert_mapping) -> str:
    if expert is not None:
        for param_part, weight_part, e, s in expert_mapping:
            if e == expert and s == shard and param_part in name:
                return name.replace(param_part, weight_part)
        return f"{name} (expert {expert}, shard {shard})"
    for param_part, shard_part, shard_id in stacked_params:
        if shard_id == shard and param_part in name:
            return name.replace(param_part, shard_part)
    return f"{name} (shard {shard!r})"
