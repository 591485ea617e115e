"""vLLM's distributed state for one rank in the test process, so vLLM layers and models can be built
and loaded in-process (``initialize_model``, quant methods) without starting an engine."""

from __future__ import annotations

import socket


def ensure_single_rank_parallel_state() -> None:
    """A one-rank gloo world and TP=PP=1 groups, once per process (call inside ``set_current_vllm_config``)."""
    import torch.distributed as dist
    from vllm.distributed import init_distributed_environment, initialize_model_parallel, parallel_state
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo"
        )
    if model_parallel_is_initialized() and getattr(parallel_state, "_EP", True) is None:
        # vLLM 0.32 makes the expert-parallel group only when the current config is an MoE model; a state
        # made earlier in this process for a dense model lacks it, so it is made again
        parallel_state.destroy_model_parallel()
    if not model_parallel_is_initialized():
        initialize_model_parallel(1, 1)
