"""`vllm serve` on a converted tiny RWKV-7 (World tokenizer, no --trust-remote-code),
and what the adapter refuses, each with a clear message."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from _rwkv7_cases import engine_configs
from _rwkv7_ref import rwkv_package_logits

from ascend_adapters.common.server import VllmServer
from ascend_adapters.rwkv7.tiny import make_tiny
from ascend_adapters.rwkv7.tokenizer import VOCAB_FILE

TEXT = "Hello! 你好，世界。Привет, мир! こんにちは 🙂"
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("rwkv7-serve")
    pth = root / "tiny.pth"
    return pth, make_tiny(root / "tiny-rwkv7", pth=pth)


@pytest.fixture(scope="module")
def served(tiny):
    """One server for the module; returns what the requests gave."""
    pth, model_dir = tiny
    out = {}
    with VllmServer(model_dir) as srv:
        out["cmd"] = srv.cmd
        status, tok = srv.request("/tokenize", {"model": srv.model_name, "prompt": TEXT})
        out["tokenize"] = (status, tok)
        ids = tok["tokens"] if status == 200 else [1, 2, 3]
        out["completion_ids"] = srv.complete(ids, max_tokens=6, return_token_ids=True)
        out["completion_text"] = srv.complete(TEXT, max_tokens=6, return_token_ids=True)
        out["chat"] = srv.chat([{"role": "user", "content": "Hi there"}], max_tokens=6, return_token_ids=True)
        out["log"] = srv.log_text()
    out["prompt_ids"] = ids
    return out


@pytest.mark.vllm
def test_served_tokenizer_ids_match_rwkv_package(served):
    import rwkv
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

    status, body = served["tokenize"]
    assert status == 200, body
    ref = TRIE_TOKENIZER(os.path.join(os.path.dirname(rwkv.__file__), VOCAB_FILE))
    assert body["tokens"] == ref.encode(TEXT)


@pytest.mark.vllm
def test_served_greedy_tokens_match_rwkv_package(served, tiny):
    pth, _ = tiny
    choice = served["completion_ids"]["choices"][0]
    gen = choice["token_ids"]
    assert len(gen) == 6
    ids = served["prompt_ids"]
    ref = rwkv_package_logits(pth, [ids + gen[:-1]])[0]
    assert ref[len(ids) - 1 :].argmax(-1).tolist() == gen


def _world_tokenizer():
    import rwkv
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

    return TRIE_TOKENIZER(os.path.join(os.path.dirname(rwkv.__file__), VOCAB_FILE))


@pytest.mark.vllm
def test_text_and_chat_endpoints(served, tiny):
    """Content, not types: each endpoint's tokens are the rwkv package's greedy continuation of the prompt
    the server reports, and its text is those tokens decoded by the package's World tokenizer."""
    pth, _ = tiny
    tok = _world_tokenizer()
    text = served["completion_text"]
    chat = served["chat"]
    assert text["usage"]["completion_tokens"] == 6
    c, m = text["choices"][0], chat["choices"][0]
    assert c["prompt_token_ids"] == tok.encode(TEXT)
    assert len(c["token_ids"]) == 6 and len(m["token_ids"]) == 6
    prompt_chat = chat["prompt_token_ids"]
    assert "Hi there" in tok.decode(prompt_chat)
    ref_text, ref_chat = rwkv_package_logits(
        pth, [c["prompt_token_ids"] + c["token_ids"][:-1], prompt_chat + m["token_ids"][:-1]]
    )
    assert ref_text[len(c["prompt_token_ids"]) - 1 :].argmax(-1).tolist() == c["token_ids"]
    assert ref_chat[len(prompt_chat) - 1 :].argmax(-1).tolist() == m["token_ids"]
    assert c["text"] == tok.decode(c["token_ids"])
    assert m["message"]["content"] == tok.decode(m["token_ids"])
    assert "--trust-remote-code" not in served["cmd"]
    assert "RWKV7ForCausalLM" in served["log"]


@pytest.mark.vllm
def test_refusals_and_bad_checkpoints_at_engine_configuration(tiny, tmp_path):
    _, good = tiny

    def variant(name, **changes):
        d = tmp_path / name
        shutil.copytree(good, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))
        return str(d)

    cases = [
        ["ok", str(good), {}],
        ["tp2", str(good), {"tensor_parallel_size": 2}],
        ["tp4_two_heads", str(good), {"tensor_parallel_size": 4}],
        ["prefix_caching", str(good), {"enable_prefix_caching": True}],
        ["prefix_caching_all", str(good), {"enable_prefix_caching": True, "mamba_cache_mode": "all"}],
        ["pp2", str(good), {"pipeline_parallel_size": 2}],
        ["pp3_two_layers", str(good), {"pipeline_parallel_size": 3}],
        ["config_vs_weights", variant("wrong_ffn", intermediate_size=512), {}],
        ["head_size", variant("wrong_head", head_dim=16, num_heads=4), {}],
    ]
    got = engine_configs(cases, tmp_path)
    assert got["ok"] == "OK"
    assert got["tp2"] == "OK" and got["prefix_caching"] == "OK"
    # one line (vLLM wraps it in its config validation error) naming both numbers
    assert (
        "RWKV-7 adapter: tensor parallelism splits heads across ranks: 2 heads are not divisible by "
        "tensor_parallel_size=4" in got["tp4_two_heads"]
    ), got["tp4_two_heads"]
    # vLLM 0.32 has no 'all' mode (its own validation refuses it); older engines have it and the adapter refuses it
    msg = got["prefix_caching_all"]
    assert "prefix caching with mamba_cache_mode='all' is not supported" in msg or (
        "mamba_cache_mode" in msg and "Input should be 'align' or 'none'" in msg
    ), msg
    assert got["pp2"] == "OK"
    assert (
        "RWKV-7 adapter: pipeline parallelism splits the layers across stages: pipeline_parallel_size=3 "
        "exceeds the 2 layers" in got["pp3_two_layers"]
    ), got["pp3_two_layers"]
    assert "checkpoint and config.json disagree" in got["config_vs_weights"]
    assert "'model.layers.0.ffn.key.weight' has shape [256, 64], config implies [512, 64]" in got["config_vs_weights"]
    assert "head_dim 16 is not supported" in got["head_size"]
