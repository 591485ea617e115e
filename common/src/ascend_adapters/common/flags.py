"""Environment flags: one vocabulary for every ``ASCEND_ADAPTERS_*`` variable.

Switches read ``on``/``off`` (truthy words ``1 true yes on``, falsy words
``0 false no off``); three-way settings add ``auto``. Anything else is an
error naming the variable and the words it accepts. Reading a flag imports
neither torch nor vLLM.
"""

from __future__ import annotations

import os

TRUTHY = frozenset({"1", "true", "yes", "on"})
FALSY = frozenset({"0", "false", "no", "off"})


class FlagError(ValueError):
    """An environment variable holds a value outside its vocabulary."""


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None:
        return None
    value = value.strip().lower()
    return value or None


def env_flag(name: str, default: bool = False) -> bool:
    """A switch: ``on``/``off`` and their synonyms; unset or empty gives ``default``."""
    raw = _raw(name)
    if raw is None:
        return default
    if raw in TRUTHY:
        return True
    if raw in FALSY:
        return False
    raise FlagError(f"{name}={os.environ[name]!r}: expected one of {sorted(TRUTHY | FALSY)}")


def env_choice(name: str, default: str = "auto", extra: tuple[str, ...] = ()) -> str:
    """A three-way setting: returns ``"auto"``, ``"on"``, ``"off"`` or one of ``extra``.

    Truthy words read as ``on`` and falsy words as ``off``.
    """
    raw = _raw(name)
    if raw is None:
        return default
    if raw == "auto" or raw in extra:
        return raw
    if raw in TRUTHY:
        return "on"
    if raw in FALSY:
        return "off"
    words = ["auto", "on", "off", *extra]
    raise FlagError(f"{name}={os.environ[name]!r}: expected one of {', '.join(words)} (or 1/0, true/false, yes/no)")
