"""The main job: build a tiny checkpoint, say how it will be served, serve it with `vllm serve`, ask it something.

    python -m ascend_adapters.common.demo [--model rwkv7|glm_dsa|deepseek_v4] [--cache-dir DIR] [--workdir DIR]

The default is RWKV-7, the model no other vLLM stack serves, trained here: a tiny RWKV-7
(``ascend_adapters.rwkv7.train_tiny``) learns the Zen of Python (the text of the standard library's
``this`` module) in seconds on first use, is cached (``--cache-dir``, default
``~/.cache/ascend-adapters/demo``; the demo prints the folder and how to remove it), and answers the
start of a line of it with the rest, in the corpus's words. ``--model glm_dsa`` or ``deepseek_v4`` serves
that adapter's tiny checkpoint (``ascend_adapters.<model>.tiny.make_tiny``, random weights, so its answer
is noise: it shows the path, not the model) from a temporary folder removed at the end (``--workdir``
keeps it). Before serving, the demo prints what ``ascend-adapters status --model DIR`` says (which class
serves the architecture, the kernel path, the engine against the supported range); while the server
starts it prints the seconds waited and what vLLM is doing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ascend_adapters.common.evidence import EvidenceRecord
from ascend_adapters.common.server import CPU_TEST_ARGS, RequestError, ServerStartError, VllmServer

MODELS = ("rwkv7", "glm_dsa", "deepseek_v4")
QUESTION = "What is the capital of France?"  # asked of the random-weight models (chat)
PROMPT = "Beautiful is better than"  # the trained RWKV-7 continues it (completion, greedy)
ANSWER_TOKENS = 24
# `vllm serve` of a tiny model until /v1/models answers, on this project's 2-core CPU machine (AMD EPYC, AVX2):
# 33 to 68 s measured for the RWKV-7 under a load of 3.5 to 5 (2026-12-06; `nox -s demo`: 68 s), 67 s by
# issue #48 on a fresh clone; 32 s for glm_dsa's.
STARTUP_ESTIMATE = "about 1 minute on 2 CPU cores, up to 2 on a busy machine"
PROGRESS_EVERY_S = 10.0
# vLLM's log prefix, "(APIServer pid=12) INFO 12-06 23:00:01 [api_server.py:1][extra] ": dropped from progress lines
VLLM_LOG_LINE = re.compile(r"^(\(\w+ pid=\d+\)\s*)?(INFO|WARNING|ERROR) \d\d-\d\d ")
LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\)\s*)?((DEBUG|INFO|WARNING|ERROR)\s+\S+\s+\S+\s+)?(\[[^\]]*\]\s*)*")


def _import(model: str, room: str):
    try:
        return importlib.import_module(f"ascend_adapters.{model}.{room}")
    except ModuleNotFoundError as exc:
        raise SystemExit(f"demo: the {model} adapter is not installed or has no {room} module ({exc})") from exc


def build(model: str, workdir: Path) -> tuple[Path, list[str], dict]:
    """(checkpoint dir, extra serve args, extra env) for the chosen model's tiny random checkpoint."""
    tiny = _import(model, "tiny")
    out = Path(tiny.make_tiny(workdir / f"tiny-{model}"))
    return out, list(getattr(tiny, "SERVE_ARGS", [])), dict(getattr(tiny, "SERVE_ENV", {}))


def build_trained(cache_dir: Path | None) -> tuple[Path, Path]:
    """(checkpoint dir, cache root) of the RWKV-7 trained on the Zen of Python: from the cache, else trained
    (seconds) and cached."""
    train = _import("rwkv7", "train_tiny")
    root = Path(cache_dir) if cache_dir else train.default_cache_dir()
    try:
        out = train.make_trained(root, log=lambda msg: print(f"[train] {msg}", flush=True))
    except train.TrainError as exc:
        raise SystemExit(f"demo: {exc}") from exc
    return out, root


class StartProgress:
    """While ``vllm serve`` starts: every ``every`` seconds, a line with the seconds waited and the last
    line vLLM logged (what it is doing; the estimate is printed once, before). Started by VllmServer's
    ``on_spawn``, stopped by ``stop()`` (the server ready, or failed)."""

    def __init__(self, every: float = PROGRESS_EVERY_S, out=None):
        self.every, self.out = every, out or sys.stdout
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def on_spawn(self, srv: VllmServer) -> None:
        t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(srv, t0), daemon=True)
        self._thread.start()

    def _run(self, srv: VllmServer, t0: float) -> None:
        while not self._done.wait(self.every):
            logged = (ln for ln in reversed(srv.log_text().splitlines()) if VLLM_LOG_LINE.search(ln))
            last = LOG_PREFIX.sub("", next(logged, "")).strip()[:110]
            print(
                f"[demo]   server starting: {time.monotonic() - t0:.0f} s" + (f"; vLLM: {last}" if last else ""),
                file=self.out,
                flush=True,
            )

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()


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
    ap.add_argument(
        "--cache-dir",
        type=Path,
        help="where the trained RWKV-7 is kept between runs (default: $XDG_CACHE_HOME/ascend-adapters/demo, "
        "else ~/.cache/ascend-adapters/demo)",
    )
    ap.add_argument(
        "--workdir",
        type=Path,
        help="glm_dsa / deepseek_v4: where the tiny random checkpoint is written and kept "
        "(default: a temporary folder, removed at the end)",
    )
    ap.add_argument(
        "--evidence-dir",
        type=Path,
        default=Path(".nox") / "demo-evidence",
        help="where the demo's record goes (default: .nox/demo-evidence, not the repo's evidence/)",
    )
    args = ap.parse_args(argv)
    trained = args.model == "rwkv7"
    if trained and args.workdir:
        ap.error("--workdir is for the random-weight models (glm_dsa, deepseek_v4); the RWKV-7 goes to --cache-dir")
    if not trained and args.cache_dir:
        ap.error(f"--cache-dir is for the trained RWKV-7; {args.model}'s random checkpoint goes to --workdir")

    rec = EvidenceRecord(model=args.model, gate="demo")
    temp_dir = None
    if trained:
        print("[demo] a tiny RWKV-7 trained on the Zen of Python (the standard library's `this` module)", flush=True)
        t0 = time.monotonic()
        model_dir, cache_root = build_trained(args.cache_dir)
        rec.metric("checkpoint_s", round(time.monotonic() - t0, 2))
        rec.extra["training"] = json.loads((model_dir / "train.json").read_text())
        extra_args, env = [], {}
        print(f"[demo] checkpoint: {model_dir} (kept for the next run)", flush=True)
        print(f"[demo] the demo's checkpoints live in {cache_root}; remove them with: rm -rf {cache_root}", flush=True)
    else:
        if args.workdir:
            workdir = args.workdir
        else:
            workdir = temp_dir = Path(tempfile.mkdtemp(prefix="ascend-adapters-demo-"))
        workdir.mkdir(parents=True, exist_ok=True)
        print(f"[demo] building a tiny {args.model} checkpoint (random weights) in {workdir}", flush=True)
        model_dir, extra_args, env = build(args.model, workdir)
        if temp_dir is None:
            print(f"[demo] it stays there; remove it with: rm -rf {model_dir}", flush=True)
    try:
        return _serve_and_ask(args, rec, model_dir, extra_args, env, trained)
    finally:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)


def _serve_and_ask(args, rec: EvidenceRecord, model_dir: Path, extra_args: list[str], env: dict, trained: bool) -> int:
    status_text, served_by_adapter = print_status(model_dir)
    rec.extra["status"] = status_text
    rec.check("ascend-adapters status: this project's adapter serves the checkpoint", served_by_adapter)
    serve_args = [*CPU_TEST_ARGS, *extra_args]
    progress = StartProgress()
    srv = VllmServer(model_dir, serve_args, env=env, served_model_name=f"tiny-{args.model}", on_spawn=progress.on_spawn)
    print("[demo] vllm serve " + " ".join([str(model_dir), *serve_args]), flush=True)
    print(f"[demo] (running as: {' '.join(srv.cmd)})", flush=True)
    print(f"[demo] starting the server: {STARTUP_ESTIMATE}; a line every {PROGRESS_EVERY_S:.0f} s", flush=True)
    rec.command(srv.cmd)
    try:
        with srv:
            progress.stop()
            startup = round(srv.timings.startup_s, 2)
            print(f"[demo] server ready after {startup:.1f} s", flush=True)
            rec.metric("startup_s", startup)
            rec.check("GET /v1/models 200", bool(srv.models()["data"]))
            if trained:
                question = PROMPT
                answer = srv.complete(PROMPT, max_tokens=ANSWER_TOKENS)
                text, cut = answer["choices"][0]["text"], answer["choices"][0]["finish_reason"] == "length"
                rec.extra["request"] = {"prompt": PROMPT, "max_tokens": ANSWER_TOKENS, "temperature": 0.0}
            else:
                question = QUESTION
                messages = [{"role": "user", "content": QUESTION}]
                answer = srv.chat(messages, max_tokens=24)
                text = answer["choices"][0]["message"]["content"]
                rec.extra["request"] = messages
            rec.extra["response"] = text
            rec.check("answer 200, non-empty", bool(text), text)
            if trained:
                train = _import("rwkv7", "train_tiny")
                outside = train.outside_words(text, truncated=cut)
                rec.check("the answer is made of the corpus's words", bool(train.words(text)) and not outside, outside)
    except ServerStartError as exc:
        progress.stop()
        rec.check("server start-up", False, exc.log_tail)
        path = rec.write(args.evidence_dir)
        print(f"[demo] FAILED to start: {exc}\n[demo] record: {path}", file=sys.stderr)
        return 1
    except RequestError as exc:
        rec.check("request answered", False, str(exc))
        path = rec.write(args.evidence_dir)
        print(f"[demo] FAILED: the server started but a request failed: {exc}\n[demo] record: {path}", file=sys.stderr)
        return 1
    finally:
        progress.stop()
    rec.skip("NPU path", "no Ascend NPU on this machine; the portable path ran")
    path = rec.write(args.evidence_dir)
    if trained:
        print(f"[demo] prompt: {question!r}")
        print(f"[demo] answer: {text!r}   (greedy; the model knows only the Zen of Python)")
        if not rec.passed:
            print("[demo] the answer holds words the corpus does not: the served model is not the trained one")
    else:
        print(f"[demo] Q: {question}")
        print(f"[demo] A: {text!r}   (random weights: the words are noise, the path is real)")
    print(f"[demo] evidence record: {path.resolve()}")
    return 0 if rec.passed else 1


if __name__ == "__main__":
    sys.exit(main())
