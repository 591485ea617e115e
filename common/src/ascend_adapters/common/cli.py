"""The `ascend-adapters` command.

Each feature contributes its subcommands from its own module through an
``add_parsers(subparsers)`` function; this file only assembles them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMAND_MODULES = (
    "ascend_adapters.common.admission.cli",  # manifest, check, render
    "ascend_adapters.common.status",  # status
    "ascend_adapters.common.gate.cli",  # gate
    "ascend_adapters.common.evidence.cli",  # evidence check, evidence index
    "ascend_adapters.common.plan",  # plan
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ascend-adapters",
        description="Tools for serving ascend-adapters models with vLLM: admission, status, memory plan, deployment gate.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue  # feature not installed in this build
            raise
        module.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
