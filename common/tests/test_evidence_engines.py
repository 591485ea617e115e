"""Evidence from different engine versions: separate files, one index column per engine."""

from __future__ import annotations

import json

from ascend_adapters.common import compat, evidence
from ascend_adapters.common.evidence import EvidenceRecord, record_name, write_index


def test_record_name_per_engine():
    assert record_name("parity", "0.32.0") == "parity.json"
    assert record_name("parity", "0.32.1+cpu") == "parity.json"
    assert record_name("parity", "0.28.0+empty") == "parity@vllm-0.28.0.json"
    assert record_name("parity", "0.27.1") == "parity@vllm-0.27.1.json"


def _record_as(root, model, gate, vllm, passed):
    """A record as written on engine ``vllm`` (the versions block is what the index reads)."""
    rec = EvidenceRecord(model=model, gate=gate)
    rec.check("c", passed)
    data = rec.to_dict()
    data["versions"]["vllm"] = vllm
    path = root / model / record_name(gate, vllm)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def test_engines_do_not_overwrite_and_index_has_a_column_each(tmp_path):
    a = _record_as(tmp_path, "rwkv7", "parity", "0.32.0", True)
    b = _record_as(tmp_path, "rwkv7", "parity", "0.28.0+empty", False)
    c = _record_as(tmp_path, "rwkv7", "parity", "0.27.1", True)
    _record_as(tmp_path, "glm_dsa", "serve", "0.32.0", True)
    assert len({a, b, c}) == 3 and all(p.exists() for p in (a, b, c))

    lines = write_index(tmp_path).read_text().splitlines()
    header = next(x for x in lines if x.startswith("| model |"))
    assert header == "| model | gate | vLLM 0.27.1 | vLLM 0.28.0 | vLLM 0.32.0 |"
    rwkv = next(x for x in lines if x.startswith("| rwkv7 | parity |")).split(" | ")
    assert rwkv[2].startswith("[PASS](rwkv7/parity@vllm-0.27.1.json)")
    assert rwkv[3].startswith("[FAIL](rwkv7/parity@vllm-0.28.0.json)")
    assert rwkv[4].startswith("[PASS](rwkv7/parity.json)")
    glm = next(x for x in lines if x.startswith("| glm_dsa | serve |"))
    assert glm.count("not run") == 2


def test_write_names_the_installed_engine(tmp_path):
    rec = EvidenceRecord(model="m", gate="g")
    rec.check("c", True)
    path = rec.write(tmp_path)
    data = json.loads(path.read_text())
    installed = data["versions"]["vllm"]
    assert installed is not None and data["engine_distribution"] is not None
    assert path.name == record_name("g", installed)
    assert path.name == ("g.json" if compat.is_primary_engine(compat.engine_release(installed)) else
                         f"g@vllm-{compat.engine_release(installed)}.json")  # fmt: skip
    assert evidence.SCHEMA == data["schema"]
