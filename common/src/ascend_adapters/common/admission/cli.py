"""Subcommands ``manifest``, ``check`` and ``render`` of ``ascend-adapters``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ascend_adapters.common.versions import COMPONENTS


def _software_arg(text: str) -> tuple[str, str]:
    name, sep, spec = text.partition("=")
    name = name.strip().replace("-", "_").lower()
    if not sep or name not in COMPONENTS or not spec.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=SPEC with NAME in {', '.join(COMPONENTS)}, got {text!r}")
    return name, spec.strip()


def _inside(path: str, directory: str) -> bool:
    p, d = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([p, d]) == d


def cmd_manifest(args) -> int:
    from ascend_adapters.common.admission.checks import build_manifest, dump_manifest

    if _inside(args.output, args.model_dir):
        print(f"refusing to write {args.output} inside the model directory (admission never writes there)")
        return 2
    manifest, report = build_manifest(
        args.model_dir,
        software=dict(args.require or []),
        undescribed_as_float=args.undescribed_as_float or [],
        jobs=args.jobs,
        progress=False if args.no_progress else None,
    )
    if manifest is None:
        print(f"no manifest written: {args.model_dir} fails the checks")
        print(report.format())
        return 1
    dump_manifest(manifest, args.output)
    print(
        f"wrote {args.output}: {len(manifest['files'])} files, {len(manifest['tensors'])} tensors, "
        f"id {manifest['artifact']['id']}"
    )
    for p in report.notes:
        print(f"  {p}")
    return 0


def cmd_check(args) -> int:
    from ascend_adapters.common.admission.checks import check_dir

    report = check_dir(
        args.model_dir,
        args.manifest,
        verify_hashes=not args.no_hash,
        software=not args.no_software,
        jobs=args.jobs,
        progress=False if args.no_progress else None,
    )
    if args.json:
        print(report.to_json())
    elif report.ok:
        print(report.summary_line())
        if args.verbose:
            for p in report.notes:
                print(f"  {p}")
    else:
        print(report.format())
    return 0 if report.ok else 1


def cmd_render(args) -> int:
    from ascend_adapters.common.admission.render import format_summary, render_dir

    summary, report = render_dir(args.model_dir)
    if args.json:
        print(json.dumps({"summary": summary, "problems": [str(p) for p in report.problems]}, indent=2))
    else:
        print(format_summary(summary, report))
    return 0 if report.ok else 1


def add_parsers(subparsers) -> None:
    p = subparsers.add_parser(
        "manifest",
        help="write an admission manifest (contract) for a model directory you trust",
        description="Inspect DIR (paths, safetensors headers, index, config, ModelSlim description), hash every "
        "file and write the manifest to -o FILE. Refuses directories that fail the checks.",
    )
    p.add_argument("model_dir", metavar="DIR")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="manifest path (outside DIR)")
    p.add_argument(
        "--require",
        action="append",
        type=_software_arg,
        metavar="NAME=SPEC",
        help=f"supported version range, e.g. vllm='>=0.32,<0.33'; NAME in {', '.join(COMPONENTS)}; repeatable",
    )
    p.add_argument(
        "--undescribed-as-float",
        action="append",
        metavar="TENSOR",
        help="admit this tensor although the ModelSlim description omits it, as FLOAT (e.g. MTP layers); repeatable",
    )
    p.add_argument("--jobs", type=int, default=None, help="files hashed in parallel (default: all cores)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
    p.set_defaults(func=cmd_manifest)

    p = subparsers.add_parser(
        "check",
        help="verify a model directory against its manifest",
        description="Exit 0 with one OK line, or 1 with every problem listed (each naming file/tensor/field).",
    )
    p.add_argument("model_dir", metavar="DIR")
    p.add_argument("--manifest", required=True, metavar="FILE")
    p.add_argument("--no-hash", action="store_true", help="skip sha256 (structure, sizes and headers only)")
    p.add_argument("--no-software", action="store_true", help="skip the installed-version ranges")
    p.add_argument("--jobs", type=int, default=None, help="files hashed in parallel (default: all cores)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.add_argument("-v", "--verbose", action="store_true", help="also list notes when OK")
    p.set_defaults(func=cmd_check)

    p = subparsers.add_parser("render", help="human summary of a model directory (no manifest needed)")
    p.add_argument("model_dir", metavar="DIR")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_render)


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - convenience
    parser = argparse.ArgumentParser(prog="ascend-adapters")
    add_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
