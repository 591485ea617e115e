"""Streamed sha256 of many files in parallel.

hashlib releases the GIL while hashing large buffers and ``readinto`` releases
it while reading, so a thread pool keeps every core busy without processes.
Files are scheduled largest first. A progress bar is drawn on stderr only when
stderr is a terminal.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

CHUNK_BYTES = 1 << 20


def default_jobs() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class Progress:
    """Byte-count progress on stderr; silent unless ``enabled``."""

    def __init__(self, total: int, enabled: bool, label: str = "sha256"):
        self.total, self.enabled, self.label = max(total, 1), enabled, label
        self.done = 0
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._last = 0.0

    def add(self, n: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self._last < 0.1 and self.done < self.total:
                return
            self._last = now
            frac = min(self.done / self.total, 1.0)
            rate = self.done / max(now - self._start, 1e-6) / 2**20
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac * 100:5.1f}% {rate:8.1f} MiB/s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def sha256_file(path: str | os.PathLike, progress: Progress | None = None, chunk: int = CHUNK_BYTES) -> str:
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            if progress is not None:
                progress.add(n)
    return h.hexdigest()


def hash_files(
    root: str | os.PathLike,
    rel_paths: Iterable[str],
    *,
    jobs: int | None = None,
    progress: bool | None = None,
) -> dict[str, str | Exception]:
    """sha256 hex digest of each ``root/rel`` (an exception object where reading failed)."""
    root = Path(root)
    rels = list(rel_paths)
    sizes = {}
    for rel in rels:
        try:
            sizes[rel] = os.stat(root / rel).st_size
        except OSError:
            sizes[rel] = 0
    rels.sort(key=lambda r: -sizes[r])
    if progress is None:
        progress = sys.stderr.isatty()
    bar = Progress(sum(sizes.values()), enabled=bool(progress) and bool(rels))
    jobs = max(1, min(jobs or default_jobs(), len(rels) or 1))
    out: dict[str, str | Exception] = {}

    def one(rel: str):
        try:
            return rel, sha256_file(root / rel, bar)
        except OSError as exc:
            return rel, exc

    try:
        if jobs == 1:
            results = map(one, rels)
            out.update(results)
        else:
            with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
                out.update(pool.map(one, rels))
    finally:
        bar.close()
    return out
