"""Declarative checkpoint-name remapping.

A remap is an ordered list of rules applied to each checkpoint name in turn:

* ``rename(pattern, repl, transform=None)``: ``re.sub(pattern, repl, name)``
  where the pattern matches; an optional transform is applied to the tensor
  ("transpose", "squeeze", or any callable).
* ``skip(pattern, reason)``: the name is dropped on purpose and reported.

After the chain, the resulting name must be one the model owns (``targets``);
otherwise it is *unmapped*, which is an error. Nothing is dropped silently:
``RemapReport`` lists mapped, skipped, unmapped and (when targets are given)
unused names.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

Transform = Callable[[Any], Any]

_NAMED_TRANSFORMS: dict[str, Transform] = {
    "transpose": lambda t: t.t().contiguous() if t.dim() == 2 else t.transpose(-1, -2).contiguous(),
    "squeeze": lambda t: t.squeeze(),
    "flatten": lambda t: t.reshape(-1),
}


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern
    repl: str | None  # None: skip
    transform: Transform | None = None
    reason: str = ""

    def describe(self) -> str:
        if self.repl is None:
            return f"skip /{self.pattern.pattern}/ ({self.reason})"
        return f"/{self.pattern.pattern}/ -> {self.repl!r}"


def rename(pattern: str, repl: str, transform: str | Transform | None = None) -> Rule:
    if isinstance(transform, str):
        try:
            transform = _NAMED_TRANSFORMS[transform]
        except KeyError:
            raise ValueError(f"unknown transform {transform!r}; known: {sorted(_NAMED_TRANSFORMS)}") from None
    return Rule(re.compile(pattern), repl, transform)


def prefix(old: str, new: str) -> Rule:
    return rename("^" + re.escape(old), new.replace("\\", "\\\\"))


def skip(pattern: str, reason: str) -> Rule:
    if not reason:
        raise ValueError("a skip rule needs a reason")
    return Rule(re.compile(pattern), None, reason=reason)


class RemapError(ValueError):
    pass


@dataclass
class RemapReport:
    mapped: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    unmapped: dict[str, str] = field(default_factory=dict)  # source -> name after the rules
    unused: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"mapped {len(self.mapped)}, skipped {len(self.skipped)}, unmapped {len(self.unmapped)}"]
        lines += [f"  skipped {k}: {v}" for k, v in sorted(self.skipped.items())]
        lines += [
            f"  UNMAPPED {k} (became {v!r}, which the model does not have)" for k, v in sorted(self.unmapped.items())
        ]
        lines += [f"  unused target {k}" for k in self.unused]
        return "\n".join(lines)


@dataclass
class Remapper:
    rules: list[Rule]
    targets: set[str] | Callable[[str], bool] | None = None
    source: str = "checkpoint"
    report: RemapReport = field(default_factory=RemapReport)

    def _owned(self, name: str) -> bool:
        if self.targets is None:
            return True
        if callable(self.targets):
            return bool(self.targets(name))
        return name in self.targets

    def map_name(self, name: str) -> tuple[str | None, list[Transform]]:
        """(new name or None if skipped, transforms). Records the outcome."""
        current, transforms = name, []
        for rule in self.rules:
            if not rule.pattern.search(current):
                continue
            if rule.repl is None:
                self.report.skipped[name] = rule.reason
                return None, []
            current = rule.pattern.sub(rule.repl, current)
            if rule.transform is not None:
                transforms.append(rule.transform)
        if not self._owned(current):
            self.report.unmapped[name] = current
            return None, []
        self.report.mapped[name] = current
        return current, transforms

    def apply(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Yield (model name, tensor) for every mapped checkpoint tensor.

        Unmapped names are collected and raised together by ``finish()``;
        call it after consuming the iterator (``remap_all`` does both).
        """
        for name, tensor in weights:
            new, transforms = self.map_name(name)
            if new is None:
                continue
            for t in transforms:
                tensor = t(tensor)
            yield new, tensor

    def finish(self, required: Iterable[str] | None = None) -> RemapReport:
        if required is not None:
            produced = set(self.report.mapped.values())
            self.report.unused = sorted(set(required) - produced)
        if self.report.unmapped:
            raise RemapError(
                f"{len(self.report.unmapped)} {self.source} tensor(s) match no rule and no model parameter "
                f"(add a rename or an explicit skip):\n{self.report.summary()}"
            )
        return self.report
