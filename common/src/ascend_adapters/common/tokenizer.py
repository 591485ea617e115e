"""A small byte-level BPE tokenizer built locally (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "Ascend NPUs run large language models with vLLM.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Once upon a time there was a small model that answered questions.",
    "One two three four five six seven eight nine ten.",
    "def main():\n    print('hello')\n",
]

SPECIAL_TOKENS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def write_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> int:
    """Train a byte-level BPE on CORPUS and save it as a HF fast tokenizer.

    Returns the real vocabulary size (<= vocab_size).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return tok.get_vocab_size()
