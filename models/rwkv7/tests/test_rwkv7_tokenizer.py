"""The World tokenizer written by the converter == the rwkv package's tokenizer."""

from __future__ import annotations

import os

import pytest

from ascend_adapters.rwkv7 import register
from ascend_adapters.rwkv7.tokenizer import VOCAB_FILE, RwkvWorldTokenizer, write_world_tokenizer

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "こんにちは世界。カタカナとひらがな。",
    "안녕하세요 세계",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "Ünïcödé façade naïve café — “quotes” ½ € ✓",
    "🙂🚀👍🏽 emoji and ZWJ 👨‍👩‍👧",
    "def f(x):\n\treturn x ** 2  # code\n\n\n    indented\r\n",
    "   leading and trailing spaces   ",
    "<|rwkv_tokenizer_end_of_text|> literal special text",
    "",
]


@pytest.fixture(scope="module")
def reference():
    import rwkv
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

    return TRIE_TOKENIZER(os.path.join(os.path.dirname(rwkv.__file__), VOCAB_FILE))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_world_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return RwkvWorldTokenizer.from_pretrained(str(tok_dir))


@pytest.mark.parametrize("text", TEXTS)
def test_ids_identical_and_round_trip(tok, reference, text):
    ids = tok.encode(text)
    assert ids == reference.encode(text)
    assert tok.decode(ids) == text


def test_long_mixed_text(tok, reference):
    text = " ".join(TEXTS) * 20
    ids = tok.encode(text)
    assert ids == reference.encode(text) and tok.decode(ids) == text


def test_autotokenizer_resolves_after_register(tok_dir):
    from transformers import AutoTokenizer

    register()
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    assert type(tok).__name__ == "RwkvWorldTokenizer"
    assert tok.eos_token_id == 0 and len(tok) == 65530
    assert (
        tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
        == "User: Hi\n\nAssistant:"
    )


def test_partial_utf8_tokens_decode_incrementally(tok):
    ids = tok.encode("😀")
    pieces = tok.convert_ids_to_tokens(ids)
    assert tok.convert_tokens_to_string(pieces) == "😀"
