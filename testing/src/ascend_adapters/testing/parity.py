"""Parity between vLLM and an independent reference forward.

``vllm_logits`` runs ``vllm.LLM`` in a fresh subprocess (so every test gets a
clean engine and plugins load exactly as in production) and returns, per
prompt, the raw float32 logits at every prompt position and generated step.
``compare`` checks them against a reference callable that maps a token-id
sequence to its logits ``[L, V]``.

Alignment: for a prompt of T tokens and n generated tokens, vLLM gives logits
for positions 0..T+n-2 (prompt logprobs cover positions 0..T-2 and predict
tokens 1..T-1; each generated step j is computed at position T-1+j). The
reference is run on ``prompt + generated[:-1]`` and compared row by row.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_LLM_KWARGS = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 256,
    "kv_cache_memory_bytes": 64 << 20,
    "max_num_seqs": 8,
}


class ParityWorkerError(RuntimeError):
    """The vLLM subprocess failed; ``log`` holds its whole output (the message only the tail)."""

    def __init__(self, returncode: int, log: str):
        tail = "\n".join(log.splitlines()[-200:])
        super().__init__(f"vLLM parity worker failed (exit {returncode}):\n{tail}")
        self.returncode = returncode
        self.log = log


@dataclass
class SeqLogits:
    prompt_ids: list[int]
    gen_ids: list[int]
    logits: object  # torch.Tensor [T + n - 1, V] float32

    @property
    def positions_ids(self) -> list[int]:
        """The token ids the reference must be run on."""
        return self.prompt_ids + self.gen_ids[:-1]


def vllm_logits(
    model_dir: str | os.PathLike,
    runs: Sequence[Sequence[Sequence[int]]],
    max_tokens: int = 8,
    *,
    llm_kwargs: dict | None = None,
    env: dict | None = None,
    timeout: float = 900.0,
    probe: str | None = None,
):
    """Greedy-generate ``max_tokens`` for each prompt with raw logits.

    ``runs`` is a list of batches; each batch is submitted as one
    ``LLM.generate`` call to the same engine (so one start-up serves e.g. a
    batched run and the same prompts one by one). With ``probe``
    (``"module:function"``, run on each worker's model through ``LLM.apply_model``
    after the runs; it returns something JSON-serialisable) the result is
    ``(runs, probe results)``. A probe module that is not installed (one beside the
    tests) is found from the test process and its folder put on the workers' path.
    """
    import torch

    spec = {
        "model": str(model_dir),
        "runs": [[list(map(int, p)) for p in batch] for batch in runs],
        "max_tokens": max_tokens,
        "llm_kwargs": {**DEFAULT_LLM_KWARGS, **(llm_kwargs or {})},
        "probe": probe,
    }
    with tempfile.TemporaryDirectory(prefix="parity-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.pt"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run(
            [sys.executable, "-m", "ascend_adapters.testing.parity_worker", str(spec_path), str(out_path)],
            env=_with_probe_path({**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **(env or {})}, probe),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0 or not out_path.exists():
            raise ParityWorkerError(proc.returncode, proc.stdout + proc.stderr)
        raw = torch.load(out_path)
    results = [[SeqLogits(r["prompt_ids"], r["gen_ids"], r["logits"]) for r in batch] for batch in raw["runs"]]
    return (results, raw["probe"]) if probe is not None else results


def _with_probe_path(env: dict, probe: str | None) -> dict:
    """``env`` with the folder of ``probe``'s module first on ``PYTHONPATH`` when that module is a
    top-level one, wherever the test process finds it: a test folder's probe, but an installed
    top-level module's folder goes first too. A module inside a package changes nothing (the
    workers import it as installed)."""
    if probe is None:
        return env
    module = probe.partition(":")[0]
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(f"probe {probe!r}: module {module!r} cannot be imported from the test process")
    if "." in module:  # inside a package, which the workers import as installed
        return env
    folder = str(Path(spec.origin).parent)
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [folder, env.get("PYTHONPATH")]))}


@dataclass
class ParityReport:
    max_abs_diff: float
    tokens_identical: bool
    first_divergence: dict | None
    per_sequence: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "max_abs_diff": self.max_abs_diff,
            "tokens_identical": self.tokens_identical,
            "first_divergence": self.first_divergence,
            "per_sequence": self.per_sequence,
        }


def compare(results: Sequence[SeqLogits], reference: Callable[[list[int]], object]) -> ParityReport:
    """Compare vLLM logits with ``reference(ids) -> logits [len(ids), V]``."""
    import torch

    worst, first, per_seq = 0.0, None, []
    for i, seq in enumerate(results):
        ref = torch.as_tensor(reference(seq.positions_ids), dtype=torch.float32)
        got = seq.logits.float()
        vocab = min(ref.shape[-1], got.shape[-1])  # vLLM may pad the vocabulary
        if ref.shape[0] != got.shape[0]:
            raise ValueError(f"sequence {i}: reference gave {ref.shape[0]} rows, vLLM {got.shape[0]}")
        diff = (ref[:, :vocab] - got[:, :vocab]).abs()
        seq_max = float(diff.max())
        worst = max(worst, seq_max)
        t = len(seq.prompt_ids)
        ref_greedy = ref[t - 1 :, :vocab].argmax(-1).tolist()
        div = None
        for j, (a, b) in enumerate(zip(seq.gen_ids, ref_greedy)):
            if a != b:
                top2 = ref[t - 1 + j, :vocab].topk(2).values
                div = {
                    "sequence": i,
                    "step": j,
                    "vllm": a,
                    "reference": b,
                    "reference_top2_gap": float(top2[0] - top2[1]),
                }
                break
        if div and first is None:
            first = div
        per_seq.append(
            {
                "prompt_len": t,
                "generated": len(seq.gen_ids),
                "max_abs_diff": seq_max,
                "worst_position": int(diff.max(-1).values.argmax()),
                "divergence": div,
            }
        )
    return ParityReport(worst, first is None, first, per_seq)


def two_rank_cpu_bind(what: str) -> dict:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a two-rank engine, one CPU per rank; skips ``what`` with fewer CPUs."""
    import pytest

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < 2:
        pytest.skip(f"{what} needs two CPUs")
    return {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[1]}"}
