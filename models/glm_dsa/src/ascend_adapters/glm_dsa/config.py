"""Serving policy for GLM-5.x DSA: which attention path a deployment gets.

DSA attends, for every query, to the ``index_topk`` previous tokens chosen by
the lightning indexer. While a context holds at most ``index_topk`` tokens the
selection keeps every token, so dense causal attention is exact. Beyond that
only a real sparse path is correct.

Environment:

* ``ASCEND_ADAPTERS_GLM_DSA_SPARSE``: ``auto`` (default; ``on`` means the same) picks
  dense when ``max_model_len <= index_topk`` and the portable sparse path otherwise;
  ``off`` disables the sparse path (start-up then refuses any
  ``max_model_len`` above ``index_topk``); ``force`` uses the sparse path even
  for short contexts (benchmarks, tests).
* ``ASCEND_ADAPTERS_GLM_DSA`` (``auto``/``on``/``off``, in ``__init__.py``): whether the
  plugin registers its class at all (``auto``: not on CUDA/ROCm, which have
  vLLM's native sparse-MLA path).
"""

from __future__ import annotations

import enum
import json
from pathlib import Path

from ascend_adapters.common.flags import FlagError, env_choice

SPARSE_ENV = "ASCEND_ADAPTERS_GLM_DSA_SPARSE"


class AttentionMode(str, enum.Enum):
    DENSE = "dense"
    SPARSE = "sparse"


class GlmDsaConfigError(ValueError):
    """A checkpoint config or serving limit this adapter cannot serve."""


def sparse_setting() -> str:
    """``auto``, ``off`` or ``force``; ``on`` reads as ``auto`` (the sparse path is available)."""
    try:
        setting = env_choice(SPARSE_ENV, extra=("force",))
    except FlagError as exc:
        raise GlmDsaConfigError(str(exc)) from None
    return "auto" if setting == "on" else setting


def require_field(hf_config, name: str):
    value = getattr(hf_config, name, None)
    if value is None:
        raise GlmDsaConfigError(
            f"config.json of this GlmMoeDsaForCausalLM checkpoint has no {name!r}; "
            f"it is required (DSA top-k selection size)"
            if name == "index_topk"
            else f"config.json of this GlmMoeDsaForCausalLM checkpoint has no {name!r}"
        )
    return value


def raw_config_dict(model: str, revision: str | None = None) -> dict | None:
    """config.json as written (before transformers fills in class defaults), or None if unreadable."""
    path = Path(model) / "config.json"
    try:
        if path.is_file():
            return json.loads(path.read_text())
        from transformers import PretrainedConfig

        return PretrainedConfig.get_config_dict(model, revision=revision)[0]
    except Exception:  # hub ids offline etc.: fall back to the parsed config
        return None


def check_raw_config(raw: dict | None) -> None:
    """Fields whose transformers default would silently change the model must be in config.json."""
    if raw is None:
        return
    cfg = raw.get("text_config", raw)
    if cfg.get("index_topk") is None:
        raise GlmDsaConfigError(
            "config.json of this GlmMoeDsaForCausalLM checkpoint has no 'index_topk': the DSA top-k size "
            "decides which tokens every query attends to, and a library default (2048) would silently "
            "change the model. Add the value the checkpoint was trained with."
        )


def choose_attention_mode(hf_config, max_model_len: int) -> AttentionMode:
    """Dense when exact, sparse otherwise; fail closed when sparse is disabled."""
    topk = int(require_field(hf_config, "index_topk"))
    if topk <= 0:
        raise GlmDsaConfigError(f"config.json index_topk={topk}: must be positive")
    setting = sparse_setting()
    if setting == "force":
        return AttentionMode.SPARSE
    if max_model_len <= topk:
        return AttentionMode.DENSE
    if setting == "off":
        raise GlmDsaConfigError(
            f"max_model_len={max_model_len} exceeds index_topk={topk} while the DSA sparse path is "
            f"disabled ({SPARSE_ENV}=0): dense attention is exact only for contexts of at most "
            f"index_topk tokens. Use --max-model-len {topk} (the largest allowed value) or enable "
            f"the portable sparse path (unset {SPARSE_ENV})."
        )
    return AttentionMode.SPARSE
