"""The official ``rwkv`` package as the independent reference (tests only; not shipped).

The package picks its RWKV-7 code path from environment variables at import
time (``RWKV_V7_ON=1``, ``RWKV_CUDA_ON=0``), so it always runs in a fresh
subprocess: ``rwkv_package_logits`` runs this file as a script. Strategy ``cpu fp32``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RWKV_ENV = {"RWKV_V7_ON": "1", "RWKV_CUDA_ON": "0", "RWKV_JIT_ON": "1"}


def rwkv_package_logits(pth: str | os.PathLike, sequences, *, mode: str = "seq", timeout: float = 600.0):
    """Logits ``[len(ids), V]`` (float32) for every position of each token-id sequence.

    ``mode="seq"`` feeds each sequence in one ``forward(ids, None, full_output=True)``;
    ``mode="one"`` feeds token by token (``forward_one``).
    """
    import torch

    with tempfile.TemporaryDirectory(prefix="rwkv-ref-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.pt"
        spec.write_text(
            json.dumps({"pth": str(pth), "sequences": [list(map(int, s)) for s in sequences], "mode": mode})
        )
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), str(spec), str(out)],
            env={**os.environ, **RWKV_ENV},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
            raise RuntimeError(f"rwkv package reference failed (exit {proc.returncode}):\n{tail}")
        return torch.load(out)


def _main(spec_path: str, out_path: str) -> int:
    for k, v in RWKV_ENV.items():
        if os.environ.get(k) != v:
            raise SystemExit(f"run with {k}={v} set before import (see rwkv_package_logits)")
    import torch
    from rwkv.model import RWKV

    spec = json.loads(Path(spec_path).read_text())
    pth = spec["pth"]
    model = RWKV(model=pth[: -len(".pth")] if pth.endswith(".pth") else pth, strategy="cpu fp32")
    results = []
    with torch.no_grad():
        for ids in spec["sequences"]:
            if spec["mode"] == "seq" and len(ids) > 1:
                logits, _ = model.forward(ids, None, full_output=True)
            else:
                state, rows = None, []
                for t in ids:
                    out, state = model.forward([t], state)
                    rows.append(out.float().clone())
                logits = torch.stack(rows)
            results.append(logits.float().reshape(len(ids), -1).clone())
    torch.save(results, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(_main(*sys.argv[1:]))
