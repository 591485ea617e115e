"""`nox -s demo`'s program (``python -m ascend_adapters.common.demo``), run as a user runs it (issue #48 items 2, 3).

The served test trains the demo's tiny RWKV-7 into a fresh cache folder (seconds), serves it with `vllm serve`
through the demo and reads the demo's output and record: the answer continues the prompt with the Zen of Python
itself, in the corpus's words; the demo said where the checkpoint is kept and how to remove it, and printed
progress lines while the server started. A second run reuses the cached checkpoint without training. The other
tests start no engine: the demo's refusals of options that do not apply to the chosen model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ascend_adapters.common import demo
from ascend_adapters.rwkv7 import train_tiny

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def _demo(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ascend_adapters.common.demo", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)


@pytest.mark.vllm
def test_demo_answers_with_the_corpus_and_says_where_its_checkpoint_is(tmp_path):
    cache, evidence = tmp_path / "cache", tmp_path / "evidence"
    run = _demo("--cache-dir", str(cache), "--evidence-dir", str(evidence))
    out = run.stdout
    assert run.returncode == 0, out[-4000:] + run.stderr[-4000:]
    record = json.loads((evidence / "rwkv7" / "demo.json").read_text())
    assert record["passed"], record["checks"]

    # trained here, within the budget, and kept where the demo says, with the command that removes it
    training = record["extra"]["training"]
    assert training["stopped"] == "reproduces the corpus" and training["seconds"] < 120, training
    model_dir = train_tiny.trained_dir(cache)
    assert (model_dir / "config.json").is_file()
    assert f"[demo] checkpoint: {model_dir}" in out
    assert f"remove them with: rm -rf {cache}" in out

    # the answer: the corpus's own continuation of the prompt, in its words
    answer = record["extra"]["response"]
    assert record["extra"]["request"]["prompt"] == demo.PROMPT
    assert len(train_tiny.words(answer)) >= 8, answer
    assert demo.PROMPT + answer in train_tiny.corpus(), answer
    assert not train_tiny.outside_words(answer, truncated=True), answer
    assert f"[demo] answer: {answer!r}" in out

    # progress while the server started: a line per PROGRESS_EVERY_S waited
    startup = record["metrics"]["startup_s"]
    ticks = [line for line in out.splitlines() if line.startswith("[demo]   server starting: ")]
    assert f"[demo] starting the server: {demo.STARTUP_ESTIMATE}" in out
    assert len(ticks) >= int(startup // demo.PROGRESS_EVERY_S) - 1, (startup, ticks)
    assert f"[demo] server ready after {startup:.1f} s" in out

    # a second run reuses the checkpoint: no training (checked without starting another engine)
    again = train_tiny.make_trained(cache, log=lambda msg: ticks.append(msg))
    assert again == model_dir and ticks[-1] == f"reusing the trained checkpoint {model_dir}"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workdir", "x"], "--workdir is for the random-weight models"),
        (["--model", "glm_dsa", "--cache-dir", "x"], "--cache-dir is for the trained RWKV-7"),
    ],
)
def test_options_that_do_not_apply_are_refused(args, message, tmp_path):
    run = _demo(*args, "--evidence-dir", str(tmp_path), timeout=120)
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert not any(tmp_path.iterdir())  # refused before anything was built or served
