"""The routed experts are safe to capture as a graph: no host read, and one op sequence for every step.

On an NPU each op is a kernel launch and vllm-ascend captures whole decode steps as graphs (ACL graph);
a captured step replays the kernels it recorded. So the experts (``common.swiglu_experts``,
``modelslim.w8a8_dynamic_moe``, portable and NPU implementations) must read no device value on the
host (``HostReads`` records every op that would) and dispatch the same ops whatever the batch size and
whichever experts the router picked: the same multiset of aten ops for T = 1 and T = 16, for routes
spread over the experts, all on one expert (the others idle), with negative ids, and all on another
rank. On the NPU path each torch_npu call (through the contract emulator: a check on CPU, not an NPU
run) counts as one op, and what the emulator computes inside it is not counted.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from ascend_adapters.common import dispatch  # noqa: E402
from ascend_adapters.common import kernels as _  # noqa: E402,F401  (registers common.swiglu_experts)
from ascend_adapters.common.quant import kernels as _q  # noqa: E402,F401  (registers modelslim.*)
from ascend_adapters.testing.capture import HostReads, emulated_npu_kernels  # noqa: E402

E, H, INTER, K = 4, 64, 32, 2  # local experts, hidden, intermediate, routes per token


class OpCounts(TorchDispatchMode):
    """The aten ops a block dispatches, by name; a torch_npu call under ``npu_calls`` counts as one op
    (its name) and the ops the emulator runs inside it are not counted."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self._in_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._in_kernel:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def npu_calls(self):
        module = sys.modules["torch_npu"]
        saved = {n: getattr(module, n) for n in dir(module) if n.startswith("npu_")}

        def counted(name, fn):
            @functools.wraps(fn)
            def call(*args, **kwargs):
                self.ops[f"torch_npu.{name}"] += 1
                self._in_kernel += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._in_kernel -= 1

            return call

        for name, fn in saved.items():
            setattr(module, name, counted(name, fn))
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(module, name, fn)


def _routing(name: str, t: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(topk_ids, expert_map)``: this rank holds global experts 1, 3, 5, 7 (an interleaved placement)
    as local 0..3 in every case, so every case takes the same code."""
    emap = torch.full((2 * E,), -1, dtype=torch.int32)
    emap[1::2] = torch.arange(E, dtype=torch.int32)
    if name == "spread":
        ids = torch.randint(0, 2 * E, (t, K), generator=g)
    elif name == "one_expert":
        ids = torch.full((t, K), 5)  # local 2; the others idle
    elif name == "negative":
        ids = torch.full((t, K), 3)
        ids[:, 1] = -1
    else:  # every route to another rank
        ids = torch.zeros(t, K, dtype=torch.long)
    return ids.to(torch.int32), emap


def _op_and_weights(op: str, g: torch.Generator, dtype: torch.dtype):
    if op == "common.swiglu_experts":
        w13 = (torch.randn(E, 2 * INTER, H, generator=g) / H**0.5).to(dtype)
        w2 = (torch.randn(E, H, INTER, generator=g) / INTER**0.5).to(dtype)
        fn = dispatch.op(op)
        return lambda x, w, ids, emap: fn(x, w13, w2, w, ids, expert_map=emap, limit=None)
    w13 = torch.randint(-127, 128, (E, 2 * INTER, H), dtype=torch.int8, generator=g)
    w2 = torch.randint(-127, 128, (E, H, INTER), dtype=torch.int8, generator=g)
    s13, s2 = torch.rand(E, 2 * INTER, generator=g) * 1e-2, torch.rand(E, H, generator=g) * 1e-2
    pack, scales, fn = dispatch.op("modelslim.pack_weight"), dispatch.op("modelslim.pack_moe_scale"), dispatch.op(op)
    w13, w2, s13, s2 = pack(w13), pack(w2), scales(s13, dtype), scales(s2, dtype)
    return lambda x, w, ids, emap: fn(x, w13, s13, w2, s2, w, ids, expert_map=emap)


CASES = [(1, "spread"), (16, "spread"), (16, "one_expert"), (16, "negative"), (16, "elsewhere")]


@pytest.mark.parametrize("kernels", ["portable", "emulated_npu"])
@pytest.mark.parametrize("op", ["common.swiglu_experts", "modelslim.w8a8_dynamic_moe"])
def test_experts_read_nothing_on_host_and_dispatch_one_op_sequence(op, kernels):
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    seen = {}
    with emulated_npu_kernels() if kernels == "emulated_npu" else contextlib.nullcontext():
        run = _op_and_weights(op, g, dtype)
        for t, routing in CASES:
            x = torch.randn(t, H, generator=g).to(dtype)
            w = torch.rand(t, K, generator=g)
            ids, emap = _routing(routing, t, g)
            reads, counts = HostReads(), OpCounts()
            npu_calls = counts.npu_calls() if kernels == "emulated_npu" else contextlib.nullcontext()
            with npu_calls, counts, reads:
                y = run(x, w, ids, emap)
            assert y.shape == x.shape and bool(torch.isfinite(y).all())
            assert reads.seen == [], (t, routing, reads.seen)
            seen[(t, routing)] = counts.ops
            if routing == "elsewhere":
                assert torch.equal(y, torch.zeros_like(y))
    first = seen[CASES[0]]
    npu_ops = {name for name in first if name.startswith("torch_npu.")}
    if kernels == "emulated_npu":
        assert {"torch_npu.npu_moe_init_routing_v2", "torch_npu.npu_moe_token_unpermute"} <= npu_ops, first
        assert first["torch_npu.npu_grouped_matmul"] == 2  # one per projection
    else:
        # one grouped GEMM per projection (H and I within one exact float32 block for W8A8), one combine
        assert not npu_ops and first["aten._grouped_mm.default"] == 2 and first["aten.index_add_.default"] == 1
    for case, ops in seen.items():
        assert ops == first, (case, sorted((ops - first).items()), sorted((first - ops).items()))
