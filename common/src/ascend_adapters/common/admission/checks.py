"""Inspect a model directory, write a manifest for it, check it against one.

Nothing here imports torch or writes into the model directory: files are
opened read-only, headers are parsed from bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from ascend_adapters.common.admission import schema
from ascend_adapters.common.admission.description import (
    DESCRIPTION_FILE,
    check_description,
    load_description,
    summarize,
)
from ascend_adapters.common.admission.hashing import hash_files
from ascend_adapters.common.admission.report import Report
from ascend_adapters.common.admission.safetensors_header import Header, TensorInfo, read_header
from ascend_adapters.common.admission.tree import relpath_problem, scan_tree

INDEX_SUFFIX = ".safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


@dataclasses.dataclass
class Inspection:
    """What a directory holds, as far as it could be read."""

    root: str
    files: dict[str, int]  # rel path -> size
    headers: dict[str, Header]  # rel path of each valid shard
    tensors: dict[str, tuple[str, TensorInfo]]  # name -> (shard, info)
    config: dict | None
    description: dict | None
    undescribed: list[str]


def _read_json(path: Path, where: str, code: str, report: Report):
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        report.error(code, where, f"cannot parse JSON ({exc})")
        return None


def _check_index(root: Path, rel: str, files: Mapping[str, int], headers: Mapping[str, Header], report: Report):
    index = _read_json(root / rel, rel, "index-json", report)
    if index is None:
        return set()
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        report.error("index-json", rel, "index has no 'weight_map' object")
        return set()
    unknown = set(index) - {"weight_map", "metadata"}
    if unknown:
        report.error("index-json", rel, f"unknown top-level keys {sorted(unknown)}")
    base = rel.rpartition("/")[0]
    referenced: dict[str, set[str]] = {}
    unsafe: dict[object, bool] = {}
    for name, shard in index["weight_map"].items():
        key = shard if isinstance(shard, str) else id(shard)
        if key not in unsafe:
            unsafe[key] = not isinstance(shard, str) or relpath_problem(shard) is not None
        if unsafe[key]:
            report.error("index-path", f"{rel}:{name}", f"shard reference {shard!r} is not a safe relative path")
            continue
        shard_rel = f"{base}/{shard}" if base else shard
        referenced.setdefault(shard_rel, set()).add(name)
    for shard_rel, names in sorted(referenced.items()):
        if shard_rel not in files:
            report.error("index-shard-missing", shard_rel, f"referenced by {rel} but not on disk")
            continue
        header = headers.get(shard_rel)
        if header is None:
            continue  # the shard's own problems are already reported
        for name in sorted(names - set(header.tensors)):
            report.error("index-tensor-missing", f"{shard_rel}:{name}", f"{rel} maps it here, the shard lacks it")
        for name in sorted(set(header.tensors) - names):
            report.error("index-tensor-unlisted", f"{shard_rel}:{name}", f"in the shard but not in {rel}")
    meta = index.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        report.error("index-json", rel, "'metadata' is not an object")
    elif meta and "total_size" in meta:
        shards = [headers[s] for s in referenced if s in headers]
        if len(shards) == len(referenced):
            total = sum(t.nbytes for h in shards for t in h.tensors.values())
            if meta["total_size"] != total:
                report.error(
                    "index-total-size",
                    rel,
                    f"metadata.total_size {meta['total_size']!r} != {total} data bytes in its shards",
                )
    return set(referenced)


def inspect_dir(
    model_dir: str | os.PathLike, report: Report, *, undescribed_as_float: Iterable[str] = ()
) -> Inspection | None:
    """Everything that can be checked without a manifest; problems go to ``report``."""
    root = Path(model_dir)
    report.model_dir = report.model_dir or str(root)
    if not root.is_dir():
        report.error("dir-missing", str(root), "not a directory")
        return None
    files = scan_tree(root, report)
    headers: dict[str, Header] = {}
    tensors: dict[str, tuple[str, TensorInfo]] = {}
    shards = sorted(r for r in files if r.endswith(".safetensors"))
    for rel in shards:
        header = read_header(root / rel, report, where=rel)
        if header is None:
            continue
        headers[rel] = header
        for name, info in header.tensors.items():
            if name in tensors:
                report.error("tensor-duplicate", name, f"in both {tensors[name][0]} and {rel}")
            else:
                tensors[name] = (rel, info)
    if not shards:
        report.error("no-weights", str(root), "no *.safetensors file")
    for rel in sorted(files):
        if rel.lower().endswith(PICKLE_SUFFIXES):
            report.error("pickle-file", rel, "pickle-format file (may run code when loaded): not admitted")
    indexes = sorted(r for r in files if r.endswith(INDEX_SUFFIX))
    covered: set[str] = set()
    for rel in indexes:
        covered |= _check_index(root, rel, files, headers, report)
    if indexes:
        for rel in shards:
            if rel not in covered:
                report.error("index-shard-unlisted", rel, f"shard not referenced by any index ({', '.join(indexes)})")
    config = None
    if "config.json" not in files:
        report.error("config-missing", "config.json", "missing")
    else:
        config = _read_json(root / "config.json", "config.json", "config-json", report)
        if config is not None and not isinstance(config, dict):
            report.error("config-json", "config.json", "not a JSON object")
            config = None
    description, undescribed = None, []
    if DESCRIPTION_FILE in files:
        description = load_description(root / DESCRIPTION_FILE, DESCRIPTION_FILE, report)
        if description is not None:
            flat = {name: info for name, (_, info) in tensors.items()}
            broken = [rel for rel in shards if rel not in headers]
            undescribed = check_description(
                description,
                flat,
                report,
                where=DESCRIPTION_FILE,
                undescribed_as_float=undescribed_as_float,
                tensors_complete=not broken,
            )
            if broken:
                report.note(
                    "ms-partial",
                    DESCRIPTION_FILE,
                    f"tensor-level checks skipped: unreadable shard header(s) {', '.join(broken)}",
                )
    elif list(undescribed_as_float):
        report.error("ms-undescribed", DESCRIPTION_FILE, "undescribed-as-float names given, but no description")
    report.stats.update(
        files=len(files), bytes=sum(files.values()), tensors=len(tensors), shards=len(shards), hashed=False
    )
    return Inspection(str(root), files, headers, tensors, config, description, undescribed)


def _identity(config: Mapping | None) -> tuple[str | None, list[str]]:
    if not config:
        return None, []
    mt = config.get("model_type")
    archs = config.get("architectures") or []
    return (mt if isinstance(mt, str) else None), [a for a in archs if isinstance(a, str)]


def content_id(files: Iterable[Mapping]) -> str:
    """The artifact id: sha256 over the sorted (sha256, size, path) lines of every file."""
    lines = sorted(f"{f['sha256']} {f['size']} {f['path']}" for f in files)
    return "sha256:" + hashlib.sha256("\n".join(lines).encode()).hexdigest()


def build_manifest(
    model_dir: str | os.PathLike,
    *,
    software: Mapping[str, str | None] | None = None,
    undescribed_as_float: Iterable[str] = (),
    jobs: int | None = None,
    progress: bool | None = None,
) -> tuple[dict | None, Report]:
    """A manifest for a directory you trust; ``None`` (and the reasons) when it fails the checks."""
    report = Report(model_dir=str(model_dir))
    allowed = sorted(set(undescribed_as_float))
    insp = inspect_dir(model_dir, report, undescribed_as_float=allowed)
    soft = {k: None for k in schema.COMPONENTS}
    for key, spec in (software or {}).items():
        if key not in soft:
            report.error("software-key", key, f"unknown component (known: {', '.join(schema.COMPONENTS)})")
            continue
        schema.version_spec(spec, f"software.{key}", report)
        soft[key] = spec
    if insp is None or not report.ok:
        return None, report
    digests = hash_files(insp.root, sorted(insp.files), jobs=jobs, progress=progress)
    for rel, d in digests.items():
        if isinstance(d, Exception):
            report.error("file-unreadable", rel, f"cannot read: {d}")
    if not report.ok:
        return None, report
    report.stats["hashed"] = True
    files = [{"path": rel, "size": insp.files[rel], "sha256": digests[rel]} for rel in sorted(insp.files)]
    model_type, archs = _identity(insp.config)
    tensors = [
        {"name": name, "file": rel, "dtype": info.dtype, "shape": list(info.shape)}
        for name, (rel, info) in sorted(insp.tensors.items())
    ]
    modelslim = None
    if insp.description is not None:
        modelslim = {"description": DESCRIPTION_FILE, **summarize(insp.description), "undescribed_as_float": allowed}
    manifest = {
        "format": schema.FORMAT,
        "version": schema.VERSION,
        "artifact": {"id": content_id(files), "model_type": model_type, "architectures": archs},
        "files": files,
        "tensors": tensors,
        "modelslim": modelslim,
        "software": soft,
    }
    check = Report()
    if not schema.validate(manifest, check):  # the writer must satisfy its own reader
        report.extend(check)
        return None, report
    return manifest, report


def dumps_manifest(manifest: Mapping) -> str:
    """JSON text with one line per file and per tensor (diff-friendly, compact for large models)."""
    parts = []
    for key, value in manifest.items():
        if isinstance(value, list) and value:
            rows = ",\n".join("  " + json.dumps(row) for row in value)
            parts.append(f" {json.dumps(key)}: [\n{rows}\n ]")
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def dump_manifest(manifest: Mapping, path: str | os.PathLike) -> None:
    Path(path).write_text(dumps_manifest(manifest))


def load_manifest(path: str | os.PathLike, report: Report) -> dict | None:
    """Read and validate a manifest file; ``None`` (with the reasons in ``report``) when invalid."""
    where = f"manifest {path}"
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        report.error("manifest-unreadable", where, str(exc))
        return None
    try:
        from ascend_adapters.common.admission.safetensors_header import _no_duplicates

        manifest = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:
        report.error("manifest-json", where, f"not valid JSON ({exc})")
        return None
    if not schema.validate(manifest, report):
        return None
    return manifest


def check_software(spec: Mapping[str, str | None], report: Report, installed: Mapping | None = None) -> None:
    """Installed versions inside the declared ranges; a component that is absent is noted, not failed."""
    from ascend_adapters.common.versions import installed_versions

    installed = installed if installed is not None else installed_versions()
    wanted = {k: v for k, v in spec.items() if v}
    if not wanted:
        return
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    for key, rng in wanted.items():
        have = installed.get(key)
        if have is None:
            report.note("software-absent", key, f"not installed here; range {rng} not checked")
            continue
        try:
            ok = SpecifierSet(rng).contains(Version(have), prereleases=True)
        except InvalidVersion:
            report.error("software-version", key, f"installed version {have!r} cannot be compared with {rng}")
            continue
        if not ok:
            report.error("software-version", key, f"installed {have} is outside the declared range {rng}")


def check_dir(
    model_dir: str | os.PathLike,
    manifest: Mapping | str | os.PathLike,
    *,
    verify_hashes: bool = True,
    software: bool = True,
    jobs: int | None = None,
    progress: bool | None = None,
    installed: Mapping | None = None,
) -> Report:
    """Check ``model_dir`` against ``manifest`` (a dict or a path); every problem is in the report."""
    report = Report(model_dir=str(model_dir))
    try:
        _check_dir(report, model_dir, manifest, verify_hashes, software, jobs, progress, installed)
    except Exception as exc:  # fail closed on anything unforeseen, with the reason
        report.error("internal", str(model_dir), f"check aborted: {type(exc).__name__}: {exc}")
    return report


def _report_missing_files(report: Report, manifest: Mapping, missing: set[str]) -> None:
    """One ``file-missing`` line per declared file that is not on disk, with the number of declared tensors
    it held (those tensors are not listed one by one: a lost shard of a large checkpoint held thousands) and
    the index that references it (inspection's ``index-shard-missing`` line for it is folded in here)."""
    if not missing:
        return
    held: dict[str, int] = {}
    for t in manifest["tensors"]:
        held[t["file"]] = held.get(t["file"], 0) + 1
    indexed: dict[str, str] = {}
    kept = []
    for p in report.problems:
        if p.code == "index-shard-missing" and p.where in missing:
            indexed[p.where] = p.message.removesuffix(" but not on disk")
        else:
            kept.append(p)
    report.problems[:] = kept
    for rel in sorted(missing):
        message = "declared in the manifest, not in the directory"
        n = held.get(rel, 0)
        if n:
            message += f"; it held {n} declared tensor{'s' if n != 1 else ''}"
        if rel in indexed:
            message += f"; {indexed[rel]}"
        report.error("file-missing", rel, message)


def _check_dir(report, model_dir, manifest, verify_hashes, software, jobs, progress, installed) -> None:
    if not isinstance(manifest, Mapping):
        manifest = load_manifest(manifest, report)
        if manifest is None:
            return
    elif not schema.validate(manifest, report):
        return
    ms = manifest["modelslim"]
    allowed = ms["undescribed_as_float"] if ms else ()
    insp = inspect_dir(model_dir, report, undescribed_as_float=allowed)
    if insp is None:
        return
    if content_id(manifest["files"]) != manifest["artifact"]["id"]:
        report.error("manifest-id", "manifest.artifact.id", "does not match the declared files (edited manifest?)")

    declared = {f["path"]: f for f in manifest["files"]}
    missing = set(declared) - set(insp.files)
    _report_missing_files(report, manifest, missing)
    for rel in sorted(set(insp.files) - set(declared)):
        kind = "safetensors shard" if rel.endswith(".safetensors") else "file"
        report.error("file-undeclared", rel, f"{kind} on disk but not in the manifest")
    to_hash = []
    for rel in sorted(set(declared) & set(insp.files)):
        want, have = declared[rel]["size"], insp.files[rel]
        if want != have:
            report.error("file-size", rel, f"size {have} != declared {want}")
        else:
            to_hash.append(rel)

    # Tensor inventory.
    want_t = {t["name"]: t for t in manifest["tensors"]}
    for name in sorted(set(want_t) - set(insp.tensors)):
        shard = want_t[name]["file"]
        if shard in missing:
            continue  # counted on the file's one file-missing line
        if shard in insp.headers or shard not in insp.files:
            report.error("tensor-missing", f"{shard}:{name}", "declared tensor not found")
    for name in sorted(set(insp.tensors) - set(want_t)):
        report.error("tensor-undeclared", f"{insp.tensors[name][0]}:{name}", "tensor not in the manifest")
    for name in sorted(set(want_t) & set(insp.tensors)):
        t, (rel, info) = want_t[name], insp.tensors[name]
        if t["file"] != rel:
            report.error("tensor-file", f"{rel}:{name}", f"declared in {t['file']}")
        if t["dtype"] != info.dtype or list(info.shape) != t["shape"]:
            report.error(
                "tensor-meta", f"{rel}:{name}", f"{info.dtype} {list(info.shape)}, declared {t['dtype']} {t['shape']}"
            )

    # Identity.
    model_type, archs = _identity(insp.config)
    art = manifest["artifact"]
    if insp.config is not None:
        if model_type != art["model_type"]:
            report.error("config-identity", "config.json:model_type", f"{model_type!r}, declared {art['model_type']!r}")
        if archs != art["architectures"]:
            report.error("config-identity", "config.json:architectures", f"{archs}, declared {art['architectures']}")

    # ModelSlim.
    if ms is None and insp.description is not None:
        report.error("ms-unexpected", DESCRIPTION_FILE, "present, but the manifest declares a float artifact")
    if ms is not None:
        if ms["description"] not in insp.files:
            report.error("ms-description-missing", ms["description"], "declared ModelSlim description is missing")
        elif insp.description is not None:
            got = summarize(insp.description)
            for key in ("version", "model_quant_type", "type_counts"):
                if got[key] != ms[key]:
                    report.error("ms-summary", f"{ms['description']}:{key}", f"{got[key]!r}, declared {ms[key]!r}")

    if software:
        check_software(manifest["software"], report, installed)

    if verify_hashes:
        digests = hash_files(insp.root, to_hash, jobs=jobs, progress=progress)
        for rel in to_hash:
            d = digests[rel]
            if isinstance(d, Exception):
                report.error("file-unreadable", rel, f"cannot read: {d}")
            elif d != declared[rel]["sha256"]:
                report.error("file-sha256", rel, f"sha256 {d[:16]}... != declared {declared[rel]['sha256'][:16]}...")
        report.stats["hashed"] = True
