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
    assert torch.Tensor.tolist is tolist  # restored
    assert mode.custom_ops == ["vllm.ascend_adapters_test_reads_on_host.default"]
    assert sorted(mode.seen) == ["Tensor.tolist", "aten.index.Tensor", "aten.item.default"], mode.seen
    assert mode.outside == ["Tensor.tolist"]  # the other two were inside the registered op
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
