"""The soak's short form in the test command (issue #49, item 1): each adapter behind `vllm serve` for 40 seconds
of 32 concurrent clients' mixed traffic (ascend_adapters.testing.soak; `nox -s soak` runs 10 minutes each).

Every check of the run must pass: no 5xx, every good request answered, bad ones a 4xx, every completed greedy
answer equal to the same request served alone, vLLM's counters read. RSS is recorded, not checked: 40 seconds end
inside the workers' warm-up (soak.RSS_CHECK_MINUTES; `nox -s soak` checks it). Served eager (`nox -s soak`: as
deployed, compiled).
"""

from __future__ import annotations

import json

import pytest

from ascend_adapters.testing.soak import MODELS, soak

SHORT_MINUTES = 2 / 3  # three adapters, two minutes of traffic in all


@pytest.mark.vllm
@pytest.mark.parametrize("model", MODELS)
def test_soak_short(model, tmp_path, evidence_root):
    # eager: compiling under the test command's load took 140 to 180 s of each start; `nox -s soak` serves compiled
    rec = soak(model, SHORT_MINUTES, tmp_path, evidence_root, gate="soak_short", eager=True)
    assert [n["what"] for n in rec.not_run if n["what"] == "rss_growth_within_bound"], rec.not_run
    failed = [c for c in rec.checks if not c["passed"]]
    log = (tmp_path / "serve.log").read_text(errors="replace") if failed else ""
    assert not failed, json.dumps(failed, indent=1, default=str)[:6000] + "\n" + log[-3000:]
    counters = rec.metrics["vllm_counters"]
    assert counters["prefix_cache_hits"] > 0, counters  # the shared prefixes hit
    assert rec.metrics["greedy_compared_with_alone"] >= 100, rec.metrics["requests_by_kind"]
