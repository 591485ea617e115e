"""The main job: build a tiny checkpoint, serve it with `vllm serve`, ask it something.

    python -m ascend_adapters.common.demo [--model llama|rwkv7|glm_dsa|deepseek_v4] [--workdir DIR]

`llama` is vLLM's own Llama reached through the test layer's probe plugin;
the others call ``ascend_adapters.<model>.tiny.make_tiny``. Weights are
random, so the answer is gibberish by design: the demo shows the path
(plugin discovery, start-up, a chat request answered), not the model.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path

from ascend_adapters.common.server import CPU_TEST_ARGS, RequestError, ServerStartError, VllmServer
from ascend_adapters.common.testing.evidence import EvidenceRecord
from ascend_adapters.common.testing.probe import PROBE_ENV

MODELS = ("llama", "rwkv7", "glm_dsa", "deepseek_v4")
QUESTION = "What is the capital of France?"


def build(model: str, workdir: Path) -> tuple[Path, list[str], dict]:
    """(checkpoint dir, extra serve args, extra env) for the chosen model."""
    out = workdir / f"tiny-{model}"
    if model == "llama":
        from ascend_adapters.common.testing.factory import make_tiny_llama

        args = ["--hf-overrides", json.dumps({"architectures": ["AscendProbeLlamaForCausalLM"]})]
        return make_tiny_llama(out), args, {PROBE_ENV: "1"}
    try:
        tiny = importlib.import_module(f"ascend_adapters.{model}.tiny")
    except ModuleNotFoundError as exc:
        raise SystemExit(f"demo: the {model} adapter is not installed or has no tiny model yet ({exc})") from exc
    return Path(tiny.make_tiny(out)), list(getattr(tiny, "SERVE_ARGS", [])), dict(getattr(tiny, "SERVE_ENV", {}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=MODELS, default="llama")
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

    rec = EvidenceRecord(model=args.model if args.model != "llama" else "llama_probe", gate="demo")
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
