"""Subcommand ``gate`` of ``ascend-adapters``.

    ascend-adapters gate MODEL_DIR [options] -- <vllm serve arguments>

Everything after ``--`` goes to ``vllm serve`` unchanged (both stages); the
dummy stage adds ``--load-format dummy``.
"""

from __future__ import annotations

import argparse
import sys

USAGE = "%(prog)s MODEL_DIR [options] -- [vllm serve arguments ...]"
EPILOG = """\
examples:
  ascend-adapters gate /models/Qwen3-8B -- --tensor-parallel-size 2 --max-model-len 8192
  ascend-adapters gate /models/m --manifest m.manifest.json --prompt "The capital of France is" --expect Paris \\
      --evidence-dir ./evidence -- --tensor-parallel-size 8 --enable-expert-parallel
  ascend-adapters gate /models/m --dry-run -- --tensor-parallel-size 8

exit status: 0 every check passed; 1 a check failed (admission, start-up, false ready, output);
2 bad input; 128+N interrupted by signal N (130 for Ctrl-C). The server is always stopped.
"""


def _options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """The gate's own options; with ``suppress`` no defaults are set (second parse pass)."""

    def d(value):
        return argparse.SUPPRESS if suppress else value

    parser.add_argument("--architecture", metavar="A", default=d(None),
                        help="architecture to serve (default: architectures[0] of config.json, or the "
                             "--hf-overrides given); when it differs, the gate adds --hf-overrides "
                             "'{\"architectures\": [A]}' and checks vLLM resolved it")  # fmt: skip
    parser.add_argument(
        "--manifest",
        metavar="M",
        default=d(None),
        help="admission manifest (ascend-adapters manifest): checked before any server starts",
    )
    parser.add_argument(
        "--no-hash",
        dest="verify_hashes",
        action="store_false",
        default=d(True),
        help="admission without sha256 (structure, sizes, headers, versions only)",
    )
    parser.add_argument("--prompt", metavar="P", default=d(None), help="extra greedy request in the real stage")
    parser.add_argument(
        "--expect", metavar="S", default=d(None), help="substring the output of --prompt must contain (e.g. Paris)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=d(32), metavar="N", help="tokens generated for --prompt (default 32)"
    )
    parser.add_argument(
        "--evidence-dir",
        metavar="D",
        default=d("evidence"),
        help="where the record goes: D/<name>/deployment_gate.json + D/index.md (default ./evidence)",
    )
    parser.add_argument(
        "--log-dir",
        metavar="L",
        default=d(None),
        help="keep the server logs (dummy.log, real.log) in L (default: a temp dir, removed after a pass)",
    )
    parser.add_argument("--name", default=d(None), help="model name in the record (default: the directory name)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        default=d(False),
        help="print every command (admission, serve, requests, stop) and run nothing",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=d(1800.0),
        metavar="S",
        help="seconds each server may take to answer GET /v1/models (default 1800)",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=d(600.0), metavar="S", help="seconds per request (default 600)"
    )


def add_parsers(subparsers) -> None:
    p = subparsers.add_parser(
        "gate",
        help="deployment gate: admission, dummy-weight and real-weight vllm serve checks, evidence record",
        description="Start `vllm serve` twice (dummy weights, then real weights), check start-up, /v1/models, "
        "completions, chat, non-empty and deterministic greedy output, and write one evidence JSON.",
        usage=USAGE,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _options(p, suppress=False)
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="MODEL_DIR [options] -- ...",
                   help="the model directory, more gate options, then -- and the vllm serve arguments")  # fmt: skip
    p.set_defaults(func=cmd_gate, _gate_parser=p)


def split_rest(args: argparse.Namespace) -> argparse.Namespace:
    """Fill ``model_dir`` and ``serve_args`` from the REMAINDER (options after MODEL_DIR parsed again)."""
    rest = list(args.rest)
    if rest and rest[0] == "--":  # `gate -- DIR ...`
        rest = rest[1:]
    if not rest or rest[0].startswith("-"):
        args._gate_parser.error("MODEL_DIR is required (ascend-adapters gate MODEL_DIR [options] -- ...)")
    args.model_dir = rest[0]
    rest = rest[1:]
    if "--" in rest:
        i = rest.index("--")
        own, args.serve_args = rest[:i], rest[i + 1 :]
    else:
        own, args.serve_args = rest, []
    second = argparse.ArgumentParser(prog=args._gate_parser.prog, add_help=False)
    _options(second, suppress=True)
    extra, unknown = second.parse_known_args(own, namespace=args)
    if unknown:
        args._gate_parser.error(f"unknown gate option(s) {' '.join(unknown)}; put vllm serve arguments after --")
    return extra


def cmd_gate(args: argparse.Namespace) -> int:
    from ascend_adapters.common.gate.runner import GateOptions, UsageError, run_gate

    split_rest(args)
    if args.expect is not None and args.prompt is None:
        args._gate_parser.error("--expect needs --prompt")
    opts = GateOptions(
        model_dir=args.model_dir,
        serve_args=args.serve_args,
        architecture=args.architecture,
        manifest=args.manifest,
        prompt=args.prompt,
        expect=args.expect,
        evidence_dir=args.evidence_dir,
        name=args.name,
        dry_run=args.dry_run,
        startup_timeout=args.startup_timeout,
        request_timeout=args.request_timeout,
        max_tokens=args.max_tokens,
        verify_hashes=args.verify_hashes,
        log_dir=args.log_dir,
    )
    try:
        return run_gate(opts).exit_code
    except UsageError as exc:
        print(f"ascend-adapters gate: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - convenience
    from ascend_adapters.common.cli import main as cli_main

    return cli_main(["gate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
