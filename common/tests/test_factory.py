import json

from safetensors import safe_open

from ascend_adapters.testing.factory import (
    make_checkpoint,
    make_tiny_llama,
    tiny_llama_config,
    tiny_llama_weights,
)


def test_tiny_llama_layout(tmp_path):
    d = make_tiny_llama(tmp_path / "m", seed=3)
    cfg = json.loads((d / "config.json").read_text())
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").shape == (cfg["vocab_size"], cfg["hidden_size"])
    assert names == set(tiny_llama_weights(cfg))
    assert "model.layers.1.mlp.down_proj.weight" in names


def test_sharded_checkpoint_has_consistent_index(tmp_path):
    cfg = tiny_llama_config()
    d = make_checkpoint(tmp_path / "s", cfg, tiny_llama_weights, max_shard_bytes=300_000, tokenizer=False)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    for name, shard in index["weight_map"].items():
        with safe_open(str(d / shard), "pt") as f:
            assert name in f.keys()


def test_seeded_weights_are_reproducible():
    cfg = tiny_llama_config()
    a, b, c = tiny_llama_weights(cfg, seed=1), tiny_llama_weights(cfg, seed=1), tiny_llama_weights(cfg, seed=2)
    assert all((a[k] == b[k]).all() for k in a)
    assert not (a["lm_head.weight"] == c["lm_head.weight"]).all()


def test_local_tokenizer_round_trip_and_chat_template(tmp_path):
    from transformers import AutoTokenizer

    d = make_tiny_llama(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(str(d))
    text = "The capital of France is Paris. Ünïcödé ok?"
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>hi<|assistant|>"
