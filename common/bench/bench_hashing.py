"""Admission benchmark: sha256 throughput vs `sha256sum`, and header-check cost per GiB.

    python common/bench/bench_hashing.py --quick [--out result.json] [--evidence-dir evidence]

With --evidence-dir (or $ASCEND_ADAPTERS_EVIDENCE_DIR, set by `nox -s bench -- --evidence-dir
evidence`) the ratios go into an evidence record, common-admission/bench-hashing.json, with the
load average at start and end and the versions.

1. single file: ``hashing.sha256_file`` vs ``sha256sum FILE`` (same file, page cache warm,
   best of --repeat runs each, interleaved).
2. multi-shard directory: ``hashing.hash_files`` (parallel threads, all cores) vs one
   sequential ``sha256sum f1 f2 ...`` over the same shards.
3. header checks: ``inspect_dir`` (paths, safetensors headers, index, ModelSlim
   description, no hashing) over a synthetic W8A8_DYNAMIC export written as sparse files
   (real headers, data never read), reported per GiB of weights and per 1000 tensors, vs
   the ``safetensors`` library reading the same headers (``safe_open`` + shape/dtype of
   every tensor) when it is installed.

Ratios > 1 mean this project's code is faster than the peer. Target: single-file throughput at least
SINGLE_FILE_TARGET of sha256sum's (both are one thread over the same bytes; the exit status is 1 when missed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ascend_adapters.common.admission.checks import inspect_dir
from ascend_adapters.common.admission.hashing import default_jobs, hash_files, sha256_file
from ascend_adapters.common.admission.report import Report
from ascend_adapters.common.evidence import BenchRun, add_evidence_dir_argument, refuse_busy_machine

MiB = 1 << 20
GiB = 1 << 30
SINGLE_FILE_TARGET = 0.9


def write_random(path: Path, size: int) -> None:
    block = os.urandom(4 * MiB)
    with open(path, "wb") as f:
        left = size
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n] if left == size else os.urandom(n))
            left -= n


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def sha256sum(paths: list[Path]) -> dict[str, str]:
    out = subprocess.run(["sha256sum", *map(str, paths)], capture_output=True, text=True, check=True).stdout
    return {line.split(None, 1)[1].strip(): line.split(None, 1)[0] for line in out.splitlines()}


def bench_single(tmp: Path, size: int, repeat: int) -> dict:
    f = tmp / "single.bin"
    write_random(f, size)
    ours_digest, peer = sha256_file(f), sha256sum([f])  # warm the page cache, check agreement
    assert peer[str(f)] == ours_digest, "digest mismatch with sha256sum"
    t_ours, t_peer = [], []
    for _ in range(repeat):  # interleaved so both see the same machine load
        t_ours.append(best_of(lambda: sha256_file(f), 1))
        t_peer.append(best_of(lambda: sha256sum([f]), 1))
    f.unlink()
    ours, peer_s = min(t_ours), min(t_peer)
    return {
        "bytes": size,
        "ours_s": ours,
        "sha256sum_s": peer_s,
        "ours_MiB_s": size / MiB / ours,
        "sha256sum_MiB_s": size / MiB / peer_s,
        "speedup_vs_sha256sum": peer_s / ours,
    }


def bench_multi(tmp: Path, shards: int, size: int, repeat: int) -> dict:
    d = tmp / "multi"
    d.mkdir()
    rels = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    for rel in rels:
        write_random(d / rel, size)
    paths = [d / r for r in rels]
    ours = hash_files(d, rels, progress=False)
    peer = sha256sum(paths)
    assert all(ours[r] == peer[str(d / r)] for r in rels), "digest mismatch with sha256sum"
    t_par, t_seq, t_peer, cpu_par = [], [], [], []
    for _ in range(repeat):
        c0 = os.times()
        t_par.append(best_of(lambda: hash_files(d, rels, progress=False), 1))
        c1 = os.times()
        cpu_par.append((c1.user - c0.user + c1.system - c0.system) / t_par[-1])
        t_seq.append(best_of(lambda: hash_files(d, rels, jobs=1, progress=False), 1))
        t_peer.append(best_of(lambda: sha256sum(paths), 1))
    shutil.rmtree(d)
    total = shards * size
    par, seq, peer_s = min(t_par), min(t_seq), min(t_peer)
    return {
        "shards": shards,
        "bytes": total,
        "jobs": default_jobs(),
        "ours_parallel_s": par,
        "ours_sequential_s": seq,
        "sha256sum_sequential_s": peer_s,
        "ours_parallel_MiB_s": total / MiB / par,
        "sha256sum_MiB_s": total / MiB / peer_s,
        "speedup_vs_sequential_sha256sum": peer_s / par,
        "parallel_speedup_vs_own_sequential": seq / par,
        "parallel_cpu_utilisation": max(cpu_par),  # CPU seconds per wall second: ~jobs when cores are free
    }


def write_sparse_shard(path: Path, tensors: list[tuple[str, str, list[int]]]) -> int:
    """A valid safetensors file whose data region is a hole (nothing written)."""
    sizes = {"I8": 1, "F32": 4}
    header, off = {}, 0
    for name, dtype, shape in tensors:
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + off)
    return off


def make_synthetic_export(d: Path, gib: float, n: int = 4096, k: int = 4096, per_shard_gib: float = 4.0) -> dict:
    """A W8A8_DYNAMIC ModelSlim layout: per linear int8 [n, k] + weight_scale/offset [n, 1]."""
    d.mkdir()
    linears = max(1, int(gib * GiB / (n * k)))
    per_shard = max(1, int(per_shard_gib * GiB / (n * k)))
    desc, weight_map, total = {}, {}, 0
    shard_names = []
    nshards = (linears + per_shard - 1) // per_shard
    for s in range(nshards):
        name = f"quant_model_weights-{s + 1:05d}-of-{nshards:05d}.safetensors"
        tensors = []
        for i in range(s * per_shard, min(linears, (s + 1) * per_shard)):
            p = f"model.layers.{i // 7}.mlp.experts.{i % 7}.down_proj"
            tensors += [(p + ".weight", "I8", [n, k]), (p + ".weight_scale", "F32", [n, 1])]
            tensors += [(p + ".weight_offset", "F32", [n, 1])]
        total += write_sparse_shard(d / name, tensors)
        for t in tensors:
            desc[t[0]] = "W8A8_DYNAMIC"
            weight_map[t[0]] = name
        shard_names.append(name)
    desc.update(version="1.0.0", model_quant_type="W8A8_DYNAMIC", metadata={}, group_size=0, optional={})
    (d / "quant_model_description.json").write_text(json.dumps(desc))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / "quant_model_weights.safetensors.index.json").write_text(json.dumps(index))
    (d / "config.json").write_text(json.dumps({"architectures": ["X"], "model_type": "x"}))
    return {"bytes": total, "tensors": len(weight_map), "shards": len(shard_names), "files": shard_names}


def bench_headers(tmp: Path, gib: float, repeat: int) -> dict:
    d = tmp / "synthetic"
    info = make_synthetic_export(d, gib)
    report = Report()
    inspect_dir(d, report)
    assert report.ok, report.format()
    ours = best_of(lambda: inspect_dir(d, Report()), repeat)
    out = {
        "nominal_bytes": info["bytes"],
        "tensors": info["tensors"],
        "shards": info["shards"],
        "inspect_s": ours,
        "inspect_ms_per_GiB": ours * 1e3 / (info["bytes"] / GiB),
        "inspect_ms_per_1000_tensors": ours * 1e3 / (info["tensors"] / 1000),
    }
    try:
        from safetensors import safe_open

        def peer():
            for name in info["files"]:
                with safe_open(str(d / name), "np") as f:
                    for key in f.keys():
                        s = f.get_slice(key)
                        s.get_shape(), s.get_dtype()

        peer()
        t_peer = best_of(peer, repeat)
        out["safetensors_lib_s"] = t_peer
        out["ratio_vs_safetensors_lib"] = t_peer / ours  # < 1: our full check costs more than a bare header read
    except ImportError:
        out["safetensors_lib_s"] = None
    shutil.rmtree(d)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (CI smoke)")
    ap.add_argument("--out", help="write the numbers as JSON here")
    ap.add_argument("--dir", help="scratch directory (default: a temporary one)")
    add_evidence_dir_argument(ap)
    args = ap.parse_args()
    refuse_busy_machine(args)
    if shutil.which("sha256sum") is None:
        print("sha256sum not found: install coreutils")
        return 2
    if args.quick:
        single, shards, shard_size, gib, repeat = 64 * MiB, 4, 32 * MiB, 8, 2
    else:
        single, shards, shard_size, gib, repeat = 1 * GiB, 8, 256 * MiB, 200, 3
    run = BenchRun("common-admission", "hashing")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-hashing-") as tmp:
        tmp = Path(tmp)
        res = {
            "machine": {
                "cpus": os.cpu_count(),
                "jobs": default_jobs(),
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "loadavg_1min": os.getloadavg()[0],
            },  # fmt: skip
            "quick": args.quick,
            "single_file": bench_single(tmp, single, repeat),
            "multi_shard": bench_multi(tmp, shards, shard_size, repeat),
            "header_checks": bench_headers(tmp, gib, repeat),
        }
    s, m, h = res["single_file"], res["multi_shard"], res["header_checks"]
    print(f"single file {s['bytes'] / MiB:.0f} MiB: ours {s['ours_MiB_s']:.0f} MiB/s, sha256sum "
          f"{s['sha256sum_MiB_s']:.0f} MiB/s -> {s['speedup_vs_sha256sum']:.2f}x (target >= {SINGLE_FILE_TARGET}x)")  # fmt: skip
    print(f"{m['shards']} shards x {m['bytes'] / m['shards'] / MiB:.0f} MiB: ours ({m['jobs']} threads) "
          f"{m['ours_parallel_MiB_s']:.0f} MiB/s, sequential sha256sum {m['sha256sum_MiB_s']:.0f} MiB/s -> "
          f"{m['speedup_vs_sequential_sha256sum']:.2f}x; own parallel vs own sequential "
          f"{m['parallel_speedup_vs_own_sequential']:.2f}x (CPU utilisation {m['parallel_cpu_utilisation']:.2f} "
          f"cores; load average {res['machine']['loadavg_1min']:.1f} on {os.cpu_count()} CPUs)")  # fmt: skip
    peer = (f", safetensors library header read {h['safetensors_lib_s'] * 1e3:.1f} ms "
            f"(ratio {h['ratio_vs_safetensors_lib']:.2f}x)" if h.get("safetensors_lib_s") else "")  # fmt: skip
    print(f"header checks over {h['nominal_bytes'] / GiB:.0f} GiB / {h['tensors']} tensors / {h['shards']} shards: "
          f"{h['inspect_s'] * 1e3:.1f} ms = {h['inspect_ms_per_GiB']:.2f} ms/GiB, "
          f"{h['inspect_ms_per_1000_tensors']:.2f} ms per 1000 tensors{peer}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    run.metric("quick", args.quick)
    run.metric("results", res)
    run.check("digests agree with sha256sum (single file and every shard)", True)  # asserted above
    run.ratio("single_file_sha256_vs_sha256sum", s["ours_s"], s["sha256sum_s"], "sha256sum", MiB=s["bytes"] / MiB,
              ours_MiB_s=round(s["ours_MiB_s"], 1), peer_MiB_s=round(s["sha256sum_MiB_s"], 1))  # fmt: skip
    run.ratio("multi_shard_parallel_vs_sequential_sha256sum", m["ours_parallel_s"], m["sha256sum_sequential_s"],
              "sha256sum (sequential)", shards=m["shards"], jobs=m["jobs"],
              ours_MiB_s=round(m["ours_parallel_MiB_s"], 1), peer_MiB_s=round(m["sha256sum_MiB_s"], 1))  # fmt: skip
    if h.get("safetensors_lib_s"):
        run.ratio("header_checks_vs_safetensors_lib", h["inspect_s"], h["safetensors_lib_s"],
                  "safetensors safe_open headers", tensors=h["tensors"],
                  ours_ms_per_GiB=round(h["inspect_ms_per_GiB"], 3))  # fmt: skip
    met = run.target(
        "single-file sha256 throughput vs sha256sum",
        round(s["speedup_vs_sha256sum"], 3),
        SINGLE_FILE_TARGET,
        "admission hashes every byte of a checkpoint once; it must not be much slower than coreutils",
    )
    run.write(args.evidence_dir)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
