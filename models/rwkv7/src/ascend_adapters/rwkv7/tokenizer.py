"""The RWKV "World" tokenizer as a transformers tokenizer class.

The World tokenizer is a greedy longest match over bytes against a fixed
vocabulary (``rwkv_vocab_v20230424.txt``, shipped by the ``rwkv`` package);
no BPE merge table reproduces that, so this is a small python tokenizer.
``register()`` of this package registers it with ``AutoTokenizer``; the
converter copies the vocabulary next to the weights and writes a
``tokenizer_config.json`` naming ``RwkvWorldTokenizer``, so ``vllm serve DIR``
finds it without ``--trust-remote-code``.

Token strings are the token bytes spelled with the GPT-2 byte-to-unicode
alphabet, so a token that is part of a multi-byte character still has a
string form; decoding joins the bytes and decodes UTF-8 (invalid sequences
become U+FFFD). Id 0 is the end-of-text token (not in the vocabulary file).
"""

from __future__ import annotations

import ast
import functools
import json
import os
import shutil
from pathlib import Path

from transformers import PreTrainedTokenizer

VOCAB_FILE = "rwkv_vocab_v20230424.txt"
EOS_TOKEN = "<|rwkv_tokenizer_end_of_text|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ 'System: ' + message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n\\n' }}"
    "{% else %}{{ 'Assistant: ' + message['content'] + '\\n\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> tuple[dict[int, str], dict[str, int]]:
    """GPT-2's reversible byte <-> printable unicode character mapping."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for byte in range(256):
        if byte not in bs:
            bs.append(byte)
            cs.append(256 + extra)
            extra += 1
    enc = {b: chr(c) for b, c in zip(bs, cs)}
    return enc, {v: k for k, v in enc.items()}


def read_vocab(path: str | os.PathLike) -> dict[int, bytes]:
    """Parse the World vocabulary: lines ``<id> <python literal str|bytes> <byte length>``."""
    vocab: dict[int, bytes] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line:
                continue
            try:
                idx = int(line[: line.index(" ")])
                tok = ast.literal_eval(line[line.index(" ") : line.rindex(" ")].strip())
                length = int(line[line.rindex(" ") :])
            except (ValueError, SyntaxError) as exc:
                raise ValueError(f"{path}:{lineno}: not a World vocabulary line ({exc})") from None
            tok = tok.encode("utf-8") if isinstance(tok, str) else tok
            if not isinstance(tok, bytes) or len(tok) != length:
                raise ValueError(f"{path}:{lineno}: token length {len(tok)} != declared {length}")
            vocab[idx] = tok
    return vocab


def rwkv_package_vocab() -> Path:
    """The vocabulary file shipped by the ``rwkv`` package (needed only by the converter)."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("rwkv")
    except Exception:  # pragma: no cover
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the World vocabulary {VOCAB_FILE} comes from the 'rwkv' package: pip install rwkv "
            "(or pass --vocab PATH to the converter)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / VOCAB_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the installed 'rwkv' package")
    return path


class RwkvWorldTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": VOCAB_FILE}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, eos_token: str = EOS_TOKEN, **kwargs):
        self.vocab_file = vocab_file
        self.idx2bytes = read_vocab(vocab_file)
        self.bytes2idx = {v: k for k, v in self.idx2bytes.items()}
        self.max_token_len = max(len(b) for b in self.idx2bytes.values())
        enc, dec = _byte_alphabet()
        self._byte_enc, self._byte_dec = enc, dec
        self.encoder = {"".join(enc[x] for x in b): i for i, b in self.idx2bytes.items()}
        self.encoder[eos_token] = 0
        self.decoder = {i: s for s, i in self.encoder.items()}
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        kwargs.setdefault("chat_template", CHAT_TEMPLATE)
        kwargs.setdefault("pad_token", eos_token)
        # text is tokenized exactly like the rwkv package: a literal "<|...|>" in a prompt stays text
        kwargs.setdefault("split_special_tokens", True)
        super().__init__(eos_token=eos_token, **kwargs)

    @property
    def vocab_size(self) -> int:
        return max(self.decoder) + 1

    def get_vocab(self) -> dict[str, int]:
        vocab = dict(self.encoder)
        vocab.update(self.added_tokens_encoder)
        return vocab

    def encode_bytes(self, data: bytes) -> list[int]:
        """Greedy longest match, exactly as the ``rwkv`` package's TRIE_TOKENIZER."""
        ids, i, n, table, top = [], 0, len(data), self.bytes2idx, self.max_token_len
        while i < n:
            for length in range(min(top, n - i), 0, -1):
                idx = table.get(data[i : i + length])
                if idx is not None:
                    ids.append(idx)
                    i += length
                    break
            else:  # every single byte is in the vocabulary, so this cannot happen with the World vocab
                raise ValueError(f"byte {data[i]:#x} at offset {i} is not in the vocabulary")
        return ids

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [self.decoder[i] for i in self.encode_bytes(text.encode("utf-8"))]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder[token]

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder.get(index, EOS_TOKEN)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out = bytearray()
        for tok in tokens:
            if tok in self.added_tokens_encoder or tok == self.eos_token:
                out += tok.encode("utf-8")
            else:
                out += bytes(self._byte_dec[c] for c in tok)
        return out.decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILE
        dst = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(dst):
            shutil.copyfile(self.vocab_file, dst)
        return (dst,)


def write_world_tokenizer(out_dir: str | os.PathLike, vocab_path: str | os.PathLike | None = None) -> int:
    """Write the World tokenizer files into ``out_dir``; returns the tokenizer's vocabulary size."""
    out = Path(out_dir)
    src = Path(vocab_path) if vocab_path else rwkv_package_vocab()
    read_vocab(src)  # validate before copying
    shutil.copyfile(src, out / VOCAB_FILE)
    tok_cfg = {
        "tokenizer_class": "RwkvWorldTokenizer",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}, indent=2))
    return RwkvWorldTokenizer(vocab_file=str(out / VOCAB_FILE)).vocab_size


def register_tokenizer() -> None:
    """Make ``AutoTokenizer`` resolve ``tokenizer_class: RwkvWorldTokenizer`` and the rwkv7 config. Idempotent."""
    from transformers import AutoTokenizer

    from ascend_adapters.rwkv7.config import Rwkv7Config

    AutoTokenizer.register(Rwkv7Config, slow_tokenizer_class=RwkvWorldTokenizer, exist_ok=True)
