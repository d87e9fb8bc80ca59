"""``manifest.json``: the list of a checkpoint's files with their sizes and sha256, written last.

A checkpoint directory counts as complete only when its manifest exists and every file it lists
has the recorded size (fast check) and hash (full check). The manifest also groups files into
parts (``model``, ``optimizer``, ``state``, ``hf``) so that retention can delete one part of an
older checkpoint and say so (``pruned``) instead of leaving a directory that looks corrupt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from posttrain.checkpoint import CheckpointError

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
_CHUNK = 8 << 20  # 8 MiB reads: large enough for throughput, small enough to stay cache friendly


def sha256_file(path: Path, *, fsync: bool = False) -> str:
    """Hex sha256 of a file's bytes; ``fsync`` also forces the file to stable storage first."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        if fsync:
            os.fsync(fh.fileno())
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (best effort: some filesystems refuse directory fsync)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def list_files(root: Path) -> list[str]:
    """Every regular file below ``root`` except the manifest, as sorted POSIX relative paths."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if rel != MANIFEST_NAME:
                out.append(rel)
    return sorted(out)


def build_manifest(root: Path, *, parts: dict[str, list[str]], meta: dict[str, Any]) -> dict[str, Any]:
    """Hash every file below ``root`` (fsync'ing each, so the manifest never outlives its data).

    ``parts`` maps a part name to the relative paths (files or directories) it consists of.
    """
    rels = list_files(root)
    # hashlib releases the GIL on large buffers: shards and big files hash in parallel
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(rels)))) as pool:
        hashes = list(pool.map(lambda rel: sha256_file(root / rel, fsync=True), rels))
    files = {rel: {"size": (root / rel).stat().st_size, "sha256": h} for rel, h in zip(rels, hashes, strict=True)}
    return {
        "manifest_version": MANIFEST_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **meta,
        "parts": parts,
        "pruned": {},
        "files": files,
    }


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to ``path`` via a temporary file, fsync and rename: readers see old or new, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1, sort_keys=False)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)
    fsync_dir(path.parent)


def write_manifest(root: Path, manifest: dict[str, Any]) -> Path:
    """Write ``root/manifest.json`` atomically."""
    path = root / MANIFEST_NAME
    write_json_atomic(path, manifest)
    return path


def read_manifest(root: Path) -> dict[str, Any]:
    """The parsed manifest; ``CheckpointError`` naming the problem when it is missing or malformed."""
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST_NAME} (the save did not finish)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest: {exc}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path}: malformed manifest (no 'files' mapping)")
    if manifest.get("manifest_version") != MANIFEST_VERSION:
        raise CheckpointError(
            f"{path}: manifest version {manifest.get('manifest_version')!r}, this posttrain reads {MANIFEST_VERSION}"
        )
    return manifest


def verify_files(root: Path, manifest: dict[str, Any], *, full: bool) -> list[str]:
    """Problems with the files the manifest lists: missing, wrong size, or (``full``) wrong hash."""
    problems = []
    for rel, entry in manifest["files"].items():
        path = root / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
            continue
        size = path.stat().st_size
        if size != entry["size"]:
            problems.append(f"{rel}: {size} bytes, the manifest says {entry['size']}")
            continue
        if full and sha256_file(path) != entry["sha256"]:
            problems.append(f"{rel}: content differs from the manifest (sha256 mismatch)")
    return problems


def part_paths(manifest: dict[str, Any], part: str) -> list[str]:
    """The manifest's files that belong to ``part`` (a listed path or a file below a listed dir)."""
    prefixes = manifest.get("parts", {}).get(part, [])
    return [rel for rel in manifest["files"] if any(rel == p or rel.startswith(p + "/") for p in prefixes)]
