"""Evidence records name the sources they certify. `ascend-adapters evidence check` (CI) refuses malformed
records, bench records without a target and doc figures no linked record holds, and reports staleness without
failing; `evidence release` refuses stale records; the index names the commit that changed a record's sources."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

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


def test_check_reports_staleness_and_release_refuses_it_naming_record_and_package(tmp_path, fake_package, capsys):
    root = tmp_path / "evidence"
    before = ev.package_digest("evfake")
    (fake_package / "__pycache__" / "junk.pyc").write_bytes(b"still ignored")
    assert ev.package_digest("evfake") == before  # caches are not sources
    path = _record("fake", root, sources=("common", "evfake"))
    _record("rwkv7", root)
    assert cli_main(["evidence", "check", str(root)]) == 0
    assert cli_main(["evidence", "release", str(root)]) == 0
    (fake_package / "data.json").write_text('{"changed": true}\n')  # package data counts
    problems = ev.check_fresh(root)
    assert len(problems) == 1 and str(path) in problems[0] and "ascend_adapters.evfake" in problems[0]
    assert "ascend_adapters.common" not in problems[0]
    capsys.readouterr()
    # CI's check: staleness is reported, not an error; listed with --stale / -v only
    assert cli_main(["evidence", "check", str(root)]) == 0
    out = capsys.readouterr().out
    assert "2 records, 1 stale (sources changed since written" in out and "STALE" not in out
    assert cli_main(["evidence", "check", "-v", str(root)]) == 0
    assert f"STALE {path}" in capsys.readouterr().out
    assert cli_main(["evidence", "check", "--release", str(root)]) == 1
    # the release refuses, naming the record and the package
    assert cli_main(["evidence", "release", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"STALE {path}" in out and "ascend_adapters.evfake" in out and "refused: 1/2 records are stale" in out
    ev.write_index(root)
    # evfake lies outside the checkout: git cannot name the commit
    assert "sources changed (commit unknown): evfake" in _index_rows(root, "fake")[0]
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
    assert f"ERROR {path}: sources: missing" in capsys.readouterr().out
    assert cli_main(["evidence", "release", str(root)]) == 1
    assert "no source digest" in capsys.readouterr().out
    assert cli_main(["evidence", "check", str(tmp_path / "nothing")]) == 2
    assert cli_main(["evidence", "release", str(tmp_path / "nothing")]) == 2


def test_check_refuses_malformed_records_naming_file_and_field(tmp_path, capsys):
    root = tmp_path / "evidence"
    good = _record("tiny_llama", root)
    assert cli_main(["evidence", "check", str(root)]) == 0
    rec = json.loads(good.read_text())

    def variant(name, **change):
        bad = {**rec, **change}
        for k, v in change.items():
            if v is KeyError:
                del bad[k]
        path = root / "tiny_llama" / f"{name}.json"
        path.write_text(json.dumps(bad))
        return path

    cases = {
        variant("no_passed", passed=KeyError): "passed: missing",
        variant("passed_str", passed="yes"): "passed: is str",
        variant("duration_bool", duration_s=True): "duration_s: is bool",
        variant("versions_list", versions=["vllm"]): "versions: is list",
        variant("platform_none", platform=None): "platform: is NoneType",
        variant("sources_empty", sources={}): "sources: empty",
        variant("commands_str", commands="vllm serve"): "commands: is str",
        variant("metrics_list", metrics=[]): "metrics: is list",
        variant("checks_empty", checks=[], passed=False): "checks: empty",
        variant("check_no_passed", checks=[{"name": "ran", "detail": None}]): "checks[0].passed: missing",
        variant("check_no_detail", checks=[{"name": "ran", "passed": True}]): "checks[0].detail: missing",
        variant("passed_lies", checks=[{"name": "ran", "passed": False, "detail": None}]): "passed: True, but all",
        variant("bad_time", started_utc="yesterday"): "started_utc: 'yesterday' is not an ISO time",
        variant("no_schema", schema=KeyError): "schema: missing",
        variant("other_schema", schema="something/else"): "schema: 'something/else'",
    }
    not_json = root / "tiny_llama" / "truncated.json"
    not_json.write_text(good.read_text()[:200])
    cases[not_json] = "(file): not valid JSON"
    count, problems = ev.check_records(root)
    assert count == 1  # the good one
    for path, what in cases.items():
        assert any(line.startswith(f"{path}: {what}") for line in problems), (path, what, problems)
    assert len(problems) == len(cases)
    capsys.readouterr()
    assert cli_main(["evidence", "check", str(root)]) == 1
    out = capsys.readouterr().out
    assert out.count("ERROR ") == len(cases) and f"{len(cases)} problems" in out
    ev.write_index(root)  # a malformed record is shown as such, not a crash
    assert "[MALFORMED](tiny_llama/passed_str.json)" in (root / "index.md").read_text()


def test_a_bench_record_must_state_a_target(tmp_path, capsys):
    root = tmp_path / "evidence"
    run = ev.BenchRun("common-admission", "untargeted")
    run.ratio("x", ours_s=0.5, peer_s=2.0, peer="peer")
    run.check("digests agree with the peer", True)  # a correctness check is not a target
    path = run.write(root)
    assert cli_main(["evidence", "check", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"ERROR {path}: checks: bench record 'bench-untargeted' states no target" in out
    # the forms the benches use are all targets: BenchRun.target, a `target` in the detail, a bound in the name
    run = ev.BenchRun("common-admission", "targeted")
    run.ratio("x", ours_s=0.5, peer_s=2.0, peer="peer")
    assert run.target("x", 4.0, 0.9, "not much slower than the peer")
    rec = json.loads(run.write(root).read_text())
    assert rec["checks"][0] == {
        "name": "x >= 0.9: not much slower than the peer", "passed": True, "detail": {"value": 4.0, "target": 0.9}
    }  # fmt: skip
    assert ev.stated_targets(rec) == [rec["checks"][0]["name"]]
    for gate, check in {
        "bench_detail": ("compiled over eager", True, {"ratio": 1.3, "target": 1.0}),
        "bench_nested": ("bytes per shape", True, {"K64": {"ratio": 0.5, "target": 0.625}}),
        "bench-name": ("W8A8 >= 1.5x bf16 on every shape (worst 1.8)", True, None),
        "bench-words": ("a short request holds less than a tenth of the old page", True, "1 vs 20"),
    }.items():
        rec = ev.EvidenceRecord(model="common-quant", gate=gate)
        rec.check(*check)
        rec.write(root)
    capsys.readouterr()
    assert cli_main(["evidence", "check", str(root)]) == 1  # still the untargeted one, and only it
    out = capsys.readouterr().out
    assert out.count("ERROR ") == 1 and "bench-untargeted" in out
    path.unlink()
    assert cli_main(["evidence", "check", str(root)]) == 0
    # gate `bench` / `bench_*` written without BenchRun is a bench record too; a gate record needs no target
    rec = ev.EvidenceRecord(model="rwkv7", gate="bench")
    rec.check("greedy tokens identical", True)
    rec.write(root)
    _record("rwkv7", root)
    capsys.readouterr()
    assert cli_main(["evidence", "check", str(root)]) == 1
    out = capsys.readouterr().out
    assert out.count("ERROR ") == 1 and "rwkv7/bench.json: checks: bench record 'bench'" in out


def _docs_tree(tmp_path):
    """A checkout-like tree: README.md, docs/, evidence/ with one bench record."""
    root = tmp_path / "repo"
    rec = ev.EvidenceRecord(model="m", gate="bench-speed")
    rec.metric("ratios", {"decode_b1": {"ratio": 1.5372, "ours_tok_s": 165.2, "peer_tok_s": 107.5}})
    rec.metric("kv_cache_bytes", 805306368)
    rec.metric("startup_s", 59.31)
    rec.metric("acceptance_per_position", [0.5695, 0.3568])
    rec.check("decode_b1 >= 1.0", True, {"ratio": 1.5372, "target": 1.0})
    rec.write(root / "evidence")
    (root / "docs" / "models").mkdir(parents=True)
    return root


def test_a_doc_figure_must_be_in_the_record_its_paragraph_links(tmp_path, capsys):
    root = _docs_tree(tmp_path)
    (root / "README.md").write_text(
        "# t\n\nServed with 768 MiB of KV cache ([record](evidence/m/bench-speed.json)).\n\n"
        "| a | b |\n|---|---|\n| vLLM 0.32.0, TP=2, 12 layers, 4096 tokens | 1.54x, 165 vs 108 tok/s, "
        "start-up 59.3 s ([r](evidence/m/bench-speed.json)) |\n\n"
        "Not linked: 9.99x and 1 GiB are not checked here.\n"
    )
    (root / "docs" / "models" / "m.md").write_text(
        "Measured ([bench](../../evidence/m/bench-speed.json)): decode 1.54x plain at batch 1\n"
        "(165 tok/s), acceptance 0.57 and 0.36 at the two positions; the previous record had 0.77x.\n\n"
        "```\n1.99x in a code block ([r](../../evidence/m/bench-speed.json))\n```\n"
    )
    assert ev.check_doc_figures(root) == []
    assert cli_main(["evidence", "check", str(root / "evidence")]) == 0  # docs: the evidence dir's parent
    # a figure that the linked record does not hold: named with file, line and figure
    doc = root / "docs" / "models" / "m.md"
    doc.write_text(doc.read_text().replace("1.54x", "1.60x").replace("165 tok/s", "170 tok/s"))
    readme = root / "README.md"
    readme.write_text(readme.read_text().replace("768 MiB", "512 MiB").replace("0.57 and", "0.58 and"))
    readme.write_text(readme.read_text() + "\n- item: 3.1x, [r](evidence/m/gone.json)\n")
    problems = ev.check_doc_figures(root)
    assert problems == [
        "README.md:3: figure 512 MiB: not in the record it links (m/bench-speed.json)",
        "README.md:11: link: m/gone.json is not a record here",
        "README.md:11: figure 3.1x: not in the record it links (m/gone.json)",
        "docs/models/m.md:1: figure 1.60x: not in the record it links (m/bench-speed.json)",
        "docs/models/m.md:1: figure 170 tok/s: not in the record it links (m/bench-speed.json)",
    ], problems
    doc.write_text(doc.read_text().replace("acceptance 0.57", "acceptance 0.61"))
    assert "docs/models/m.md:1: figure acceptance 0.61: not in the record it links" in ev.check_doc_figures(root)[-1]
    capsys.readouterr()
    assert cli_main(["evidence", "check", str(root / "evidence")]) == 1
    out = capsys.readouterr().out
    assert "ERROR README.md:3: figure 512 MiB" in out and "6 problems" in out
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert cli_main(["evidence", "check", "--docs", str(elsewhere), str(root / "evidence")]) == 0


def _git(cwd, *args):
    out = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
        cwd=cwd, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.strip()


def _checkout(tmp_path, monkeypatch, files: dict[str, str]) -> tuple[Path, str]:
    """A git checkout with ``files`` in one commit, taken as the repository root: (its path, the commit)."""
    checkout = tmp_path / "checkout"
    for name, text in files.items():
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / name).write_text(text)
    _git(checkout, "init", "-q")
    _git(checkout, "add", ".")
    _git(checkout, "commit", "-qm", "first")
    monkeypatch.setattr(ev, "repo_root", lambda: checkout)
    return checkout, _git(checkout, "rev-parse", "HEAD")


def test_index_names_the_commit_that_changed_a_records_sources(tmp_path, monkeypatch):
    checkout, written_at = _checkout(tmp_path, monkeypatch, {"pkg/a.py": "A = 1\n", "other/b.py": "B = 1\n"})
    root = tmp_path / "evidence"
    path = _record("tree-model", root, sources=("tree:pkg",))
    rec = json.loads(path.read_text())
    rec["git_revision"] = written_at  # as if written in that checkout
    path.write_text(json.dumps(rec))
    ev.write_index(root)
    assert "sources fresh" in _index_rows(root, "tree-model")[0]
    (checkout / "pkg" / "a.py").write_text("A = 2\n")
    _git(checkout, "commit", "-qam", "change pkg")
    changed_in = _git(checkout, "log", "-1", "--format=%h")
    (checkout / "other" / "b.py").write_text("B = 2\n")
    _git(checkout, "commit", "-qam", "change something else")
    ev.write_index(root)
    assert f"sources changed in {changed_in}: tree:pkg" in _index_rows(root, "tree-model")[0]
    (checkout / "pkg" / "a.py").write_text("A = 3\n")
    ev.write_index(root)
    assert f"changed in {changed_in} and in the working tree: tree:pkg" in _index_rows(root, "tree-model")[0]
    # a revision git does not have (or none): the commit is unknown
    rec["git_revision"] = "0123456789abcdef0123456789abcdef01234567+dirty"
    path.write_text(json.dumps(rec))
    ev.write_index(root)
    assert "sources changed (commit unknown): tree:pkg" in _index_rows(root, "tree-model")[0]
    # no git: the digests alone
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    ev.write_index(root)
    assert "sources stale (tree:pkg)" in _index_rows(root, "tree-model")[0]


def test_changed_by_asks_git_once_per_revision_and_paths(tmp_path, monkeypatch):
    checkout, rev = _checkout(tmp_path, monkeypatch, {"pkg/a.py": "A = 1\n"})
    changed_by = ev.ChangedBy()
    calls = []
    real = changed_by._git
    monkeypatch.setattr(changed_by, "_git", lambda *a: calls.append(a) or real(*a))
    for _ in range(3):
        assert changed_by(rev, ["tree:pkg"]) == "(commit unknown)"  # no change since: git cannot say which
    assert len(calls) == 2  # one status, one log


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
