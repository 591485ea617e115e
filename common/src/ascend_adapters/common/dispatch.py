"""Kernel registry: each op has a portable torch implementation and,
where one exists, an NPU implementation. Callers never import torch_npu.

    from ascend_adapters.common import dispatch

    @dispatch.portable("rms_norm")
    def rms_norm_ref(x, w, eps): ...

    @dispatch.npu("rms_norm")
    def rms_norm_npu(x, w, eps):
        import torch_npu
        return torch_npu.npu_rms_norm(x, w, eps)[0]

    y = dispatch.op("rms_norm")(x, w, eps)

Each call picks the implementation from the device of its first tensor
argument (``platform.path_for_device``): the NPU implementation for tensors on
an NPU, the portable one otherwise.

Some calls are better served by an implementation the engine brings (vLLM's own
CustomOps, vLLM-CPU's oneDNN GEMM) where it exists and accepts the call: what
serves is only found out by trying. ``choose`` is the one way to decide that,
once per kind of call:

    choice = dispatch.choose("dsv4.hc_pre", [("vllm", make_vllm_pre)])
    choice.fn(...)        # the engine's implementation, or the op itself
    choice.source         # "vllm", or "portable: <why not>"

Each candidate's ``make()`` returns a callable when it serves the call, or a
string saying why not; the op itself serves when none does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ascend_adapters.common.flags import env_flag
from ascend_adapters.common.platform import KernelPath, path_for_device


@dataclass
class Op:
    name: str
    portable: Callable | None = None
    npu: Callable | None = None
    _resolved: dict = field(default_factory=dict, repr=False)

    def resolve(self, path: KernelPath | None = None) -> Callable:
        path = path or path_for_device("cpu")
        if path is KernelPath.NPU and self.npu is not None:
            return self.npu
        if self.portable is None:
            raise LookupError(f"kernel op {self.name!r} has no portable implementation")
        return self.portable

    def __call__(self, *args, **kwargs):
        path = path_for_device(_device_type(args, kwargs))
        fn = self._resolved.get(path)
        if fn is None:
            fn = self._resolved[path] = self.resolve(path)
        return fn(*args, **kwargs)


def _device_type(args, kwargs) -> str:
    for a in (*args, *kwargs.values()):
        device = getattr(a, "device", None)
        if device is not None:
            return device.type
    return "cpu"


_OPS: dict[str, Op] = {}


def _get(name: str) -> Op:
    return _OPS.setdefault(name, Op(name))


def _register(name: str, slot: str) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        op = _get(name)
        current = getattr(op, slot)
        qual = f"{current.__module__}.{current.__qualname__}" if current else None
        if qual is not None and qual != f"{fn.__module__}.{fn.__qualname__}":
            raise ValueError(f"kernel op {name!r} already has a {slot} implementation ({qual})")
        setattr(op, slot, fn)
        op._resolved.clear()
        return fn

    return deco


def portable(name: str) -> Callable[[Callable], Callable]:
    """Register the portable torch implementation of op ``name``."""
    return _register(name, "portable")


def npu(name: str) -> Callable[[Callable], Callable]:
    """Register the torch_npu implementation of op ``name``."""
    return _register(name, "npu")


def op(name: str) -> Op:
    """The op ``name``; raises KeyError naming known ops if unknown."""
    try:
        return _OPS[name]
    except KeyError:
        raise KeyError(f"unknown kernel op {name!r}; known: {sorted(_OPS)}") from None


def registered_ops() -> dict[str, dict[str, bool]]:
    """For `status`: which ops have which implementations."""
    return {n: {"portable": o.portable is not None, "npu": o.npu is not None} for n, o in sorted(_OPS.items())}


@dataclass(frozen=True)
class Choice:
    """The implementation chosen for one kind of call, and why (``source``)."""

    fn: Callable
    source: str


Candidate = tuple[str, Callable[[], "Callable | str"]]


def choose(name: str, candidates: list[Candidate], *, switch: str | None = None) -> Choice:
    """The first candidate ``(label, make)`` whose ``make()`` returns a callable, else the op itself.

    ``source`` is the label of the candidate chosen, or ``"portable: <reasons>"`` (each candidate's
    reason, joined with "; "). ``switch`` names an ``ASCEND_ADAPTERS_*`` variable that, when on, keeps
    the op's own implementation without trying any candidate. The caller caches the choice for its
    kind of call; nothing is cached here.
    """
    own = op(name)
    if switch is not None and env_flag(switch):
        return Choice(own, f"portable: {switch} is on")
    reasons = []
    for label, make in candidates:
        got = make()
        if callable(got):
            return Choice(got, label)
        reasons.append(str(got))
    return Choice(own, "portable: " + "; ".join(reasons))
