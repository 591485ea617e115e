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
