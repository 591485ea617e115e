"""Subcommand ``evidence`` of ``ascend-adapters``.

    ascend-adapters evidence check [DIR]    exit 1 when a record under DIR (default ./evidence)
                                            does not certify the package sources installed here
    ascend-adapters evidence index [DIR]    rewrite DIR/index.md (freshness computed now)

Fast: it hashes the package sources, it starts nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parsers(subparsers) -> None:
    p = subparsers.add_parser(
        "evidence",
        help="evidence records: check that they certify the sources here, rewrite the index",
        description="Evidence records carry a sha256 of the package sources they certify; `check` fails "
        "(exit 1) when a record's sources changed since it was written, naming the record and the package.",
    )
    sub = p.add_subparsers(dest="evidence_command", metavar="ACTION")
    c = sub.add_parser("check", help="exit 1 when a record is stale for the sources installed here")
    c.add_argument("dir", nargs="?", default="evidence", help="evidence root (default ./evidence)")
    c.set_defaults(func=cmd_check)
    i = sub.add_parser("index", help="rewrite DIR/index.md")
    i.add_argument("dir", nargs="?", default="evidence", help="evidence root (default ./evidence)")
    i.set_defaults(func=cmd_index)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def cmd_check(args: argparse.Namespace) -> int:
    from ascend_adapters.common.evidence import check_fresh, records

    root = Path(args.dir)
    found = records(root) if root.is_dir() else []
    if not found:
        print(f"evidence check: no evidence records under {root}")
        return 2
    problems = check_fresh(root)
    for line in problems:
        print(f"STALE {line}")
    print(f"evidence check: {len(found) - len(problems)}/{len(found)} records certify the sources here")
    return 1 if problems else 0


def cmd_index(args: argparse.Namespace) -> int:
    from ascend_adapters.common.evidence import write_index

    print(write_index(args.dir))
    return 0
