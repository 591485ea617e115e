"""The demo's trained tiny RWKV-7 (``ascend_adapters.rwkv7.train_tiny``, issue #48 item 2), without an engine.

* The training forward is RWKV-7 x070: its logits match the official ``rwkv`` package's on a random
  checkpoint (the parallel WKV form included), so what is trained is what the adapter serves.
* Trained on the Zen of Python, the exported full-vocabulary checkpoint (65536 ids, the unused ones held
  down through the constant channel) reproduces every line from a fresh state, greedy, in the corpus's words.
* ``make_trained`` caches: a second call reuses the folder; bad input (an empty corpus, a cache folder that
  cannot be written, a window longer than the WKV form allows) is a clear error.

The served answer (through `vllm serve`) is checked by common/tests/test_demo.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from _rwkv7_ref import rwkv_package_logits

from ascend_adapters.rwkv7 import train_tiny
from ascend_adapters.rwkv7.tiny import WORLD_VOCAB, blinkdl_state_dict, write_pth


def test_training_forward_matches_the_rwkv_package(tmp_path):
    sd = blinkdl_state_dict(n_layer=2, n_embd=64, head_size=32, vocab=300, seed=3)
    pth = write_pth(tmp_path / "ref.pth", sd)
    seqs = [[5, 17, 200, 3, 99, 42, 7, 7, 1, 250, 13, 13, 64, 2, 0, 8, 9, 11, 299, 4], [250, 1, 2]]
    ref = rwkv_package_logits(pth, seqs)
    for seq, want in zip(seqs, ref):
        got = train_tiny.forward(sd, torch.tensor([seq]))[0]
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_wkv_refuses_a_window_beyond_its_range():
    n = train_tiny.MAX_WINDOW + 1
    z = torch.zeros(1, 1, n, 32)
    with pytest.raises(ValueError, match=f"{n} positions; at most {train_tiny.MAX_WINDOW}"):
        train_tiny.wkv(z, z - 0.1, z, z, z, z)


@pytest.fixture(scope="module")
def trained():
    return train_tiny.train(train_tiny.corpus(), log=print)


def _greedy(sd, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad(), train_tiny.one_torch_thread():
        for _ in range(n):
            nxt = int(train_tiny.forward(sd, torch.tensor([out]))[0, -1].argmax())
            out.append(nxt)
            if nxt == 0:
                break
    return out[len(ids) :]


def test_trained_model_continues_each_line_with_the_corpus(trained):
    sd, report = trained
    assert report["stopped"] == "reproduces the corpus", report
    assert report["seconds"] < 120, report
    assert sd["emb.weight"].shape == (WORLD_VOCAB, train_tiny.SHAPE["n_embd"])
    tok = train_tiny._tokenizer()
    text = train_tiny.corpus()
    lines = [ln for ln in text.split("\n") if len(ln.split()) >= 4]
    # prompts whose continuation the corpus decides (the first words of the "Although ..." lines do not)
    prompts = [" ".join(ln.split()[:3]) for ln in lines]
    prompts = [p for p in prompts if text.count(p) == 1]
    assert len(prompts) >= 12, prompts
    for prompt in prompts:
        ids = tok.encode_bytes(prompt.encode())
        new = _greedy(sd, ids, 8)  # over the whole 65536-id vocabulary
        answer = tok.decode([t for t in new if t != 0])
        assert prompt + answer in text, (prompt, answer)
        assert not train_tiny.outside_words(answer, truncated=new[-1] != 0), (prompt, answer)


def test_words_of_the_corpus():
    words = train_tiny.corpus_words()
    assert {"beautiful", "ugly", "explicit", "namespaces", "aren't", "let's"} <= words
    assert "france" not in words
    assert train_tiny.words("Now is better than *right* now.") == ["now", "is", "better", "than", "right", "now"]
    assert train_tiny.outside_words(" ugly.\nExplicit is Read", truncated=True) == []
    assert train_tiny.outside_words(" ugly.\nExplicit is Read", truncated=False) == ["read"]
    assert train_tiny.outside_words(" ugly.\nExplicit is Read.", truncated=True) == ["read"]
    assert train_tiny.outside_words("Paris is the capital", truncated=True) == ["paris", "capital"]


def test_make_trained_caches_and_reuses(tmp_path):
    logs: list[str] = []
    out = train_tiny.make_trained(tmp_path, log=logs.append)
    assert out.parent == tmp_path and out == train_tiny.trained_dir(tmp_path)
    report = json.loads((out / "train.json").read_text())
    assert report["stopped"] == "reproduces the corpus"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == WORLD_VOCAB and cfg["num_hidden_layers"] == train_tiny.SHAPE["n_layer"]
    assert (out / "tokenizer_config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no leftover temporary folder
    assert any(line.startswith("training a tiny RWKV-7") for line in logs)
    again: list[str] = []
    assert train_tiny.make_trained(tmp_path, log=again.append) == out
    assert again == [f"reusing the trained checkpoint {out}"]


def test_empty_corpus_is_refused():
    with pytest.raises(train_tiny.TrainError, match="the corpus is empty"):
        train_tiny.train("  \n")


def test_unwritable_cache_is_a_clear_error(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with pytest.raises(train_tiny.TrainError, match="cannot write the demo's checkpoint cache"):
        train_tiny.make_trained(blocker / "cache", log=lambda *_: None)
