"""The capture-safety detector of the graph-mode tests (``ascend_adapters.testing.capture``) must
see what it is meant to catch, inside a registered op's body too, and nothing else: a check that
cannot fail proves nothing."""

from __future__ import annotations

import torch

from ascend_adapters.testing.capture import HostReads


def test_host_read_detector_fires_inside_custom_ops():
    """The mode must see what it is meant to catch, also inside a registered op's body."""
    from vllm.utils.torch_utils import direct_register_custom_op

    def reads_on_host(x: torch.Tensor, y: torch.Tensor) -> None:
        y.copy_(x * int(x.sum()))
        y.add_(x[x > 0].sum() + x[torch.tensor([1])].sum())

    direct_register_custom_op(op_name="ascend_adapters_test_reads_on_host", op_func=reads_on_host, mutates_args=["y"])
    tolist = torch.Tensor.tolist
    mode = HostReads()
    with mode:
        torch.ops.vllm.ascend_adapters_test_reads_on_host(torch.tensor([0.0, 3.0]), torch.empty(2))
        torch.tensor([1, 2]).tolist()
        torch.tensor([1, 2]).numpy()
    assert torch.Tensor.tolist is tolist  # restored
    assert mode.custom_ops == ["vllm.ascend_adapters_test_reads_on_host.default"]
    assert sorted(mode.seen) == ["Tensor.numpy", "Tensor.tolist", "aten.index.Tensor", "aten.item.default"], mode.seen
    assert mode.outside == ["Tensor.tolist", "Tensor.numpy"]  # the other two were inside the registered op
    assert mode.inside == {
        "vllm.ascend_adapters_test_reads_on_host.default": ["aten.item.default", "aten.index.Tensor"]
    }


def test_emulated_npu_call_is_one_device_kernel():
    """Under ``emulated_npu_kernels`` a torch_npu call is one device kernel: listed in ``kernels``, and the
    emulator's host-side checks inside it (npu_gather_sparse_index reads its index range) are not
    recorded; a read next to it still is. Dispatch takes the NPU implementation inside the block only,
    and the process's torch_npu and environment are put back after."""
    import os
    import sys

    from ascend_adapters.common import dispatch
    from ascend_adapters.common import kernels as _  # noqa: F401  (registers common.swiglu)
    from ascend_adapters.common.platform import EMULATOR_ENV, KernelPath, path_for_device
    from ascend_adapters.testing.capture import emulated_npu_kernels

    before = sys.modules.get("torch_npu"), os.environ.get(EMULATOR_ENV)
    mode = HostReads()
    with emulated_npu_kernels():
        import torch_npu

        assert path_for_device("cpu") is KernelPath.NPU
        with mode:
            torch_npu.npu_gather_sparse_index(torch.randn(4, 3), torch.tensor([3, 0]))
            dispatch.op("common.swiglu")(torch.randn(2, 8))
            torch.tensor([1.0]).item()
    assert mode.kernels == ["torch_npu.npu_gather_sparse_index", "torch_npu.npu_swiglu"]
    assert mode.seen == ["aten._local_scalar_dense.default"], mode.seen
    assert (sys.modules.get("torch_npu"), os.environ.get(EMULATOR_ENV)) == before
    assert path_for_device("cpu") is KernelPath.PORTABLE


def test_capture_freezes_what_a_step_decides_on_the_host():
    """``capture_step`` replays the recorded ops: a step that takes a host value from outside its
    inputs (here the rows to keep, as metadata handed over as Python values would) replays the value
    it had while captured, so on another step it differs from eager; a step that reads a device value
    on the host cannot be captured at all; the same step on the device replays equal to eager."""
    import pytest

    from ascend_adapters.testing.capture import capture_step

    host = {"rows": 2}

    def host_metadata(x, n):
        return x[: host["rows"]].sum() * torch.ones(1)

    def host_read(x, n):
        return x[: int(n)].sum() * torch.ones(1)

    def on_device(x, n):
        return torch.where(torch.arange(x.shape[0]) < n, x, torch.zeros_like(x)).sum() * torch.ones(1)

    x, other = torch.arange(1.0, 6.0), torch.arange(10.0, 15.0)
    for step, replays_equal in ((host_metadata, False), (on_device, True)):
        host["rows"] = 2
        graph = capture_step(step, x, torch.tensor(2))
        assert torch.equal(graph(x, torch.tensor(2)), step(x, torch.tensor(2)))
        host["rows"] = 4
        assert torch.equal(graph(other, torch.tensor(4)), step(other, torch.tensor(4))) is replays_equal, step
    with pytest.raises(RuntimeError, match="data-dependent"):
        capture_step(host_read, x, torch.tensor(2))


def test_launches_count_every_op_of_a_registered_op_body():
    """``HostReads.launches``: the ops dispatched outside and inside a Python-registered op, not the op's own call."""
    from vllm.utils.torch_utils import direct_register_custom_op

    def three_ops(x: torch.Tensor, y: torch.Tensor) -> None:
        y.copy_((x + 1) * 2)

    direct_register_custom_op(op_name="ascend_adapters_test_three_ops", op_func=three_ops, mutates_args=["y"])
    mode = HostReads()
    x, y = torch.ones(2), torch.empty(2)
    with mode:
        torch.ops.vllm.ascend_adapters_test_three_ops(x, y)
    assert dict(mode.ops) == {"aten.add.Tensor": 1, "aten.mul.Tensor": 1, "aten.copy_.default": 1}, mode.ops
    assert mode.launches == 3
