"""Fixtures shared by common's tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llama_modelslim_exports(tmp_path_factory):
    """A tiny float Llama and its real msmodelslim dynamic + static W8A8 exports, made once per run.

    Read-only for the tests: a test that mutates an export copies it first.
    """
    from ascend_adapters.testing import modelslim

    reason = modelslim.msmodelslim_missing_reason()
    if reason:
        print(f"SKIP real msmodelslim exports: {reason}")
        pytest.skip(reason)
    return modelslim.make_tiny_llama_exports(tmp_path_factory.mktemp("msmodelslim"), seed=0)
