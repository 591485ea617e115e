"""Walk a model directory safely, and validate relative paths.

Rules: every entry must be a regular file or a directory, or a symlink that
resolves to a regular file inside the model directory. Device files, FIFOs,
sockets, dangling symlinks, symlinks that leave the directory and symlinked
directories are refused. Nothing is opened here: FIFOs and devices are only
``lstat``-ed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from ascend_adapters.common.admission.report import Report


def relpath_problem(rel: str) -> str | None:
    """Why ``rel`` is not a safe relative POSIX path, or None when it is."""
    if not isinstance(rel, str) or not rel:
        return "empty path"
    if "\x00" in rel or "\\" in rel:
        return "path contains a NUL or backslash"
    if rel.startswith("/") or (len(rel) > 1 and rel[1] == ":"):
        return "absolute path"
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "path has an empty, '.' or '..' component"
    return None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return name
    return "special file"


def scan_tree(root: str | os.PathLike, report: Report) -> dict[str, int]:
    """Map of relative POSIX path -> size for every admissible file under ``root``.

    Unsafe entries are reported and left out of the map.
    """
    root_path = Path(root)
    real_root = os.path.realpath(root_path)
    files: dict[str, int] = {}

    def walk(directory: Path, rel_dir: PurePosixPath | None) -> None:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as exc:
            report.error("path-unreadable", str(rel_dir or "."), f"cannot list directory: {exc}")
            return
        for entry in entries:
            rel = str(rel_dir / entry.name) if rel_dir else entry.name
            problem = relpath_problem(rel)
            if problem:
                report.error("path-unsafe", repr(rel), problem)
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError as exc:
                report.error("path-unreadable", rel, f"cannot stat: {exc}")
                continue
            if stat.S_ISLNK(st.st_mode):
                target = os.path.realpath(entry.path)
                if os.path.commonpath([real_root, target]) != real_root:
                    report.error("path-symlink-escape", rel, f"symlink points outside the model directory ({target})")
                    continue
                try:
                    tst = os.stat(entry.path)
                except OSError:
                    report.error("path-symlink-dangling", rel, "symlink target does not exist")
                    continue
                if stat.S_ISDIR(tst.st_mode):
                    report.error("path-symlink-dir", rel, "symlinked directories are not admitted")
                    continue
                if not stat.S_ISREG(tst.st_mode):
                    report.error("path-special", rel, f"symlink to a {_kind(tst.st_mode)}")
                    continue
                files[rel] = tst.st_size
            elif stat.S_ISDIR(st.st_mode):
                walk(Path(entry.path), PurePosixPath(rel))
            elif stat.S_ISREG(st.st_mode):
                files[rel] = st.st_size
            else:
                report.error("path-special", rel, f"{_kind(st.st_mode)} in the model directory")

    walk(root_path, None)
    return files
