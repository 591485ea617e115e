"""Evidence records name the sources they certify; `ascend-adapters evidence check` notices when they change."""

from __future__ import annotations

import json
import os

import pytest

from ascend_adapters.common import evidence as ev
from ascend_adapters.common.cli import main as cli_main


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """``ascend_adapters.evfake``: a package whose sources the test can change."""
    root = tmp_path / "site"
    pkg = root / "ascend_adapters" / "evfake"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("X = 1\n")
    (pkg / "data.json").write_text("{}\n")
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "junk.pyc").write_bytes(b"ignored")
    monkeypatch.syspath_prepend(str(root))
    assert ev.package_dir("evfake") == pkg
    return pkg


def _index_rows(root, *models):
    """The index rows of these models (whatever the column layout, a row starts with its model)."""
    lines = (root / "index.md").read_text().splitlines()
    rows = [ln for ln in lines if any(ln.startswith(f"| {m} |") for m in models)]
    assert rows, lines
    return rows


def _record(model, root, **kw):
    rec = ev.EvidenceRecord(model=model, gate="g", **kw)
    rec.check("ran", True)
    return rec.write(root)


def test_record_carries_source_digests_per_model_coverage(tmp_path):
    root = tmp_path / "evidence"
    common = json.loads(_record("common-quant", root).read_text())
    # this checkout, with the test layer installed: the tests and benches that made a record are covered too
    assert set(common["sources"]) == {"common", "testing", "tree:common/tests", "tree:common/bench"}
    assert common["sources"]["common"]["files"] > 10 and len(common["sources"]["common"]["sha256"]) == 64
    rwkv = json.loads(_record("rwkv7", root).read_text())
    assert set(rwkv["sources"]) == {"common", "rwkv7", "testing", "tree:models/rwkv7/tests", "tree:models/rwkv7/bench"}
    assert all(rwkv["sources"][k] is not None for k in rwkv["sources"])
    assert rwkv["sources"]["common"] == common["sources"]["common"]
    load = common["platform"]["loadavg"]
    assert len(load) == 3 and all(x >= 0 for x in load)
    assert ev.check_fresh(root) == []
    assert cli_main(["evidence", "check", str(root)]) == 0
    assert all(" fresh " in r for r in _index_rows(root, "common-quant", "rwkv7"))


def test_check_names_the_stale_record_and_the_changed_package(tmp_path, fake_package, capsys):
    root = tmp_path / "evidence"
    before = ev.package_digest("evfake")
    (fake_package / "__pycache__" / "junk.pyc").write_bytes(b"still ignored")
    assert ev.package_digest("evfake") == before  # caches are not sources
    path = _record("fake", root, sources=("common", "evfake"))
    _record("rwkv7", root)
    assert cli_main(["evidence", "check", str(root)]) == 0
    (fake_package / "data.json").write_text('{"changed": true}\n')  # package data counts
    problems = ev.check_fresh(root)
    assert len(problems) == 1 and str(path) in problems[0] and "ascend_adapters.evfake" in problems[0]
    assert "ascend_adapters.common" not in problems[0]
    capsys.readouterr()
    assert cli_main(["evidence", "check", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"STALE {path}" in out and "1/2 records" in out
    ev.write_index(root)
    assert "stale (evfake)" in _index_rows(root, "fake")[0]
    # a file added or renamed changes the digest too
    (fake_package / "data.json").write_text("{}\n")
    assert ev.check_fresh(root) == []
    (fake_package / "new.py").write_text("")
    assert len(ev.check_fresh(root)) == 1


def test_check_refuses_records_without_digest_and_empty_dirs(tmp_path, capsys):
    root = tmp_path / "evidence"
    path = _record("tiny_llama", root)
    rec = json.loads(path.read_text())
    del rec["sources"]
    path.write_text(json.dumps(rec))
    assert cli_main(["evidence", "check", str(root)]) == 1
    assert "no source digest" in capsys.readouterr().out
    assert cli_main(["evidence", "check", str(tmp_path / "nothing")]) == 2


def test_bench_run_writes_ratio_record_with_load(tmp_path):
    run = ev.BenchRun("common-admission", "unit")
    assert run.ratio("x", ours_s=0.5, peer_s=2.0, peer="peer") == 4.0
    run.check("agrees with peer", True)
    assert run.write(None) is None  # no directory: no record
    rec = json.loads(run.write(tmp_path).read_text())
    assert rec["gate"] == "bench-unit" and rec["passed"]
    assert rec["metrics"]["ratios"]["x"] == {"ratio": 4.0, "ours_s": 0.5, "peer_s": 2.0, "peer": "peer"}
    assert rec["extra"]["load"]["cpu_count"] == os.cpu_count() and len(rec["extra"]["load"]["end"]) == 3
    assert set(rec["sources"]) == {"common", "testing", "tree:common/tests", "tree:common/bench"}


def test_a_bench_refuses_to_write_a_record_on_a_busy_machine(monkeypatch, tmp_path):
    import argparse

    ap = argparse.ArgumentParser()
    ev.add_evidence_dir_argument(ap)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.01, 0.5, 0.5))  # above 0.5 per CPU on 2 CPUs
    with pytest.raises(SystemExit, match="load average is 1.01 on 2 CPUs"):
        ev.refuse_busy_machine(ap.parse_args(["--evidence-dir", str(tmp_path)]))
    ev.refuse_busy_machine(ap.parse_args(["--evidence-dir", str(tmp_path), "--allow-busy"]))  # asked for
    monkeypatch.delenv(ev.BENCH_EVIDENCE_ENV, raising=False)
    ap = argparse.ArgumentParser()
    ev.add_evidence_dir_argument(ap)
    ev.refuse_busy_machine(ap.parse_args([]))  # no record is written: nothing to refuse
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 3.0, 3.0))  # at the bound: idle enough
    ev.refuse_busy_machine(ap.parse_args(["--evidence-dir", str(tmp_path)]))


def test_a_changed_test_or_bench_script_makes_the_record_stale(tmp_path, monkeypatch):
    """The tests and benches that judged a record are covered: editing a bound there makes it stale."""
    checkout = tmp_path / "checkout"
    (checkout / "models" / "rwkv7" / "tests").mkdir(parents=True)
    (checkout / "models" / "rwkv7" / "bench").mkdir()
    test_file = checkout / "models" / "rwkv7" / "tests" / "test_x.py"
    test_file.write_text("TOL = 1e-3\n")
    (checkout / "models" / "rwkv7" / "bench" / "bench_x.py").write_text("TARGET = 1.5\n")
    monkeypatch.setattr(ev, "repo_root", lambda: checkout)
    root = tmp_path / "evidence"
    path = _record("rwkv7", root)
    assert ev.check_fresh(root) == []
    test_file.write_text("TOL = 1e-1\n")
    problems = ev.check_fresh(root)
    assert len(problems) == 1 and str(path) in problems[0] and "models/rwkv7/tests" in problems[0]
    test_file.write_text("TOL = 1e-3\n")
    (checkout / "models" / "rwkv7" / "bench" / "bench_x.py").write_text("TARGET = 1.0\n")
    assert "models/rwkv7/bench" in ev.check_fresh(root)[0]


def test_without_the_test_layer_a_record_certifies_the_packages_alone(tmp_path, monkeypatch):
    """A deployment gate on a user's install (no checkout, no ascend-adapters-testing): common alone."""
    monkeypatch.setattr(ev, "repo_root", lambda: None)
    rec = json.loads(_record("my-glm5", tmp_path).read_text())
    assert set(rec["sources"]) == {"common"}
