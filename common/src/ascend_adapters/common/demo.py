"""The main job: build a tiny checkpoint, say how it will be served, serve it with `vllm serve`, ask it something.

    python -m ascend_adapters.common.demo [--model rwkv7|glm_dsa|deepseek_v4] [--workdir DIR]

The default is RWKV-7, the model no other vLLM stack serves. The checkpoint comes from
``ascend_adapters.<model>.tiny.make_tiny``; before serving, the demo prints what
``ascend-adapters status --model DIR`` says (which class serves the architecture, the
kernel path, the engine against the supported range). Weights are random, so the answer is
gibberish by design: the demo shows the path (plugin discovery, start-up, a chat request
answered), not the model.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.common.server import CPU_TEST_ARGS, RequestError, ServerStartError, VllmServer

MODELS = ("rwkv7", "glm_dsa", "deepseek_v4")
QUESTION = "What is the capital of France?"


def build(model: str, workdir: Path) -> tuple[Path, list[str], dict]:
    """(checkpoint dir, extra serve args, extra env) for the chosen model."""
    out = workdir / f"tiny-{model}"
    try:
        tiny = importlib.import_module(f"ascend_adapters.{model}.tiny")
    except ModuleNotFoundError as exc:
        raise SystemExit(f"demo: the {model} adapter is not installed or has no tiny model yet ({exc})") from exc
    return Path(tiny.make_tiny(out)), list(getattr(tiny, "SERVE_ARGS", [])), dict(getattr(tiny, "SERVE_ENV", {}))


def print_status(model_dir: Path) -> tuple[str, bool]:
    """Run ``ascend-adapters status --model DIR`` as a user would and print what it says about this model.

    Of the architecture rows, only those of the checkpoint's ``architectures`` are printed (the other
    adapters' rows, with their notes, are what ``ascend-adapters status`` adds for them). Returns the
    full output and whether it names this project's adapter as the class serving the checkpoint.
    """
    cmd = [sys.executable, "-m", "ascend_adapters.common.cli", "status", "--model", str(model_dir)]
    print(f"[demo] ascend-adapters status --model {model_dir}", flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print(f"[demo] (status exited {out.returncode}: {out.stderr.strip()[-500:]})", flush=True)
        return out.stdout, False
    ours = set(json.loads((model_dir / "config.json").read_text()).get("architectures") or [])
    served = any(
        line.startswith(f"  {arch}: adapter ascend_adapters.") for arch in ours for line in out.stdout.splitlines()
    )
    in_rows, keep = False, True
    for line in out.stdout.splitlines():
        if line == "architectures (native first):":
            in_rows = True
        elif in_rows and line.startswith("  ") and not line.startswith("    "):
            keep = line.strip().split(":", 1)[0] in ours
        elif in_rows and not line.startswith("  "):
            in_rows, keep = False, True
        if keep:
            print(f"[status] {line}")
    return out.stdout, served


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=MODELS, default="rwkv7")
    ap.add_argument("--workdir", type=Path, help="where the tiny checkpoint is written (default: a temp dir)")
    ap.add_argument(
        "--evidence-dir",
        type=Path,
        default=Path(".nox") / "demo-evidence",
        help="where the demo's record goes (default: .nox/demo-evidence, not the repo's evidence/)",
    )
    args = ap.parse_args(argv)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ascend-adapters-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"[demo] building a tiny {args.model} checkpoint in {workdir}", flush=True)
    model_dir, extra_args, env = build(args.model, workdir)
    status_text, served_by_adapter = print_status(model_dir)

    rec = EvidenceRecord(model=args.model, gate="demo")
    rec.extra["status"] = status_text
    rec.check("ascend-adapters status: this project's adapter serves the checkpoint", served_by_adapter)
    serve_args = [*CPU_TEST_ARGS, *extra_args]
    srv = VllmServer(model_dir, serve_args, env=env, served_model_name=f"tiny-{args.model}")
    print("[demo] vllm serve " + " ".join([str(model_dir), *serve_args]), flush=True)
    print(f"[demo] (running as: {' '.join(srv.cmd)}; about 30 s on 2 cores)", flush=True)
    rec.command(srv.cmd)
    try:
        with srv:
            rec.metric("startup_s", round(srv.timings.startup_s, 2))
            rec.check("GET /v1/models 200", bool(srv.models()["data"]))
            messages = [{"role": "user", "content": QUESTION}]
            answer = srv.chat(messages, max_tokens=24)
            text = answer["choices"][0]["message"]["content"]
            rec.check("chat completion 200, non-empty answer", bool(text), text)
            rec.extra["request"], rec.extra["response"] = messages, text
    except ServerStartError as exc:
        rec.check("server start-up", False, exc.log_tail)
        path = rec.write(args.evidence_dir)
        print(f"[demo] FAILED to start: {exc}\n[demo] record: {path}", file=sys.stderr)
        return 1
    except RequestError as exc:
        rec.check("request answered", False, str(exc))
        path = rec.write(args.evidence_dir)
        print(f"[demo] FAILED: the server started but a request failed: {exc}\n[demo] record: {path}", file=sys.stderr)
        return 1
    rec.skip("NPU path", "no Ascend NPU on this machine; the portable path ran")
    path = rec.write(args.evidence_dir)
    print(f"[demo] server ready after {srv.timings.startup_s:.1f} s")
    print(f"[demo] Q: {QUESTION}")
    print(f"[demo] A: {text!r}   (random weights: the words are noise, the path is real)")
    print(f"[demo] evidence record: {path.resolve()}")
    return 0 if rec.passed else 1


if __name__ == "__main__":
    sys.exit(main())
