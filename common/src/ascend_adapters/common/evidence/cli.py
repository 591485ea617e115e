"""Subcommand ``evidence`` of ``ascend-adapters``.

    ascend-adapters evidence check [DIR]    CI's check: exit 1 on a malformed record under DIR (default
                                            ./evidence), a bench record without a stated target, or a
                                            figure in README.md / docs/ that the record it links does not
                                            hold; reports how many records are stale, without failing
    ascend-adapters evidence release [DIR]  the release step: exit 1 while any record under DIR is stale
                                            (its sources changed since it was written), naming each
    ascend-adapters evidence index [DIR]    rewrite DIR/index.md (freshness computed now)

Fast: it hashes the package sources and reads the records and the docs, it starts nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parsers(subparsers) -> None:
    p = subparsers.add_parser(
        "evidence",
        help="evidence records: check them (CI), refuse stale ones (release), rewrite the index",
        description="Evidence records carry a sha256 of the package sources they certify. `check` (CI) fails "
        "on malformed records, bench records without a target and doc figures no linked record holds, and "
        "reports stale records without failing; `release` fails while any record is stale.",
    )
    sub = p.add_subparsers(dest="evidence_command", metavar="ACTION")
    c = sub.add_parser(
        "check",
        help="exit 1 on a malformed record, a bench record without a target or a doc figure no record holds",
    )
    c.add_argument("dir", nargs="?", default="evidence", help="evidence root (default ./evidence)")
    c.add_argument(
        "--docs",
        metavar="ROOT",
        default=None,
        help="check the figures of ROOT/README.md and ROOT/docs/**/*.md (default: DIR's parent folder, "
        "when it has a README.md or docs/)",
    )
    c.add_argument("--stale", "-v", action="store_true", help="list the stale records too (not an error)")
    c.add_argument("--release", action="store_true", help="also fail while any record is stale (as `release`)")
    c.set_defaults(func=cmd_check)
    r = sub.add_parser("release", help="exit 1 while any record is stale, naming it and the changed sources")
    r.add_argument("dir", nargs="?", default="evidence", help="evidence root (default ./evidence)")
    r.set_defaults(func=cmd_release)
    i = sub.add_parser("index", help="rewrite DIR/index.md")
    i.add_argument("dir", nargs="?", default="evidence", help="evidence root (default ./evidence)")
    i.set_defaults(func=cmd_index)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _docs_root(args: argparse.Namespace, root: Path) -> Path | None:
    if args.docs is not None:
        return Path(args.docs)
    parent = root.resolve().parent
    return parent if (parent / "README.md").is_file() or (parent / "docs").is_dir() else None


def cmd_check(args: argparse.Namespace) -> int:
    from ascend_adapters.common.evidence import check_doc_figures, check_records, stale_records

    root = Path(args.dir)
    if not root.is_dir() or not any(root.rglob("*.json")):
        print(f"evidence check: no evidence records under {root}")
        return 2
    count, problems = check_records(root)
    docs = _docs_root(args, root)
    if docs is not None:
        problems += check_doc_figures(docs, root)
    for line in problems:
        print(f"ERROR {line}")
    total, stale = stale_records(root)
    if args.stale or args.release:
        for line in stale:
            print(f"STALE {line}")
    docs_said = f"docs checked under {docs}" if docs is not None else "no docs checked"
    print(
        f"evidence check: {total} records, {len(stale)} stale (sources changed since written"
        f"{'' if args.stale or args.release or not stale else '; listed with --stale'}); {docs_said}; "
        f"{len(problems)} problem{'' if len(problems) == 1 else 's'}"
    )
    return 1 if problems or (args.release and stale) else 0


def cmd_release(args: argparse.Namespace) -> int:
    from ascend_adapters.common.evidence import check_release, records

    root = Path(args.dir)
    found = records(root) if root.is_dir() else []
    if not found:
        print(f"evidence release: no evidence records under {root}")
        return 2
    problems = check_release(root)
    for line in problems:
        print(f"STALE {line}")
    if problems:
        print(
            f"evidence release: refused: {len(problems)}/{len(found)} records are stale; regenerate them "
            "(`nox -s evidence`, `nox -s compat`, the benches) before a release"
        )
        return 1
    print(f"evidence release: {len(found)}/{len(found)} records certify the sources here")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    from ascend_adapters.common.evidence import write_index

    print(write_index(args.dir))
    return 0
