"""Fixtures and markers shared by every package's tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

EVIDENCE_ENV = "ASCEND_ADAPTERS_EVIDENCE_DIR"


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: starts a real vLLM engine (serve or LLM)")
    config.addinivalue_line("markers", "gate: a gate that writes an evidence record (rewritten by `nox -s evidence`)")


@pytest.fixture
def evidence_root(tmp_path) -> Path:
    """Where gate tests write evidence: the repo's evidence/ under `nox -s evidence`, else a tmp dir."""
    root = os.environ.get(EVIDENCE_ENV)
    return Path(root) if root else tmp_path / "evidence"
