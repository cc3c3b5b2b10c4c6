"""Artifact directories: atomic writes, sha256, the ``warsha.json`` manifest, verification.

An artifact is an HF-format model directory plus ``warsha.json``. The manifest lists every
file's sha256, so a truncated or edited weight file is caught before a later stage uses it,
and the artifact's digest (a hash of that list) is what downstream manifests record as their
input: a change anywhere upstream makes every dependent stage rerun.

Durability: every file of an artifact is fsynced before the manifest that lists it is written,
and the manifest before the directory is renamed into place; on a full disk the error surfaces
there (some filesystems report ENOSPC only at fsync), before anything that could resume the
stage is deleted.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

MANIFEST = "warsha.json"
_IGNORED_DIRS = {"checkpoints", "wandb", "__pycache__"}
_FIX = "restore it from a copy, or rerun the stage that made it with --force to rebuild it"


class ArtifactError(RuntimeError):
    """An artifact is missing, incomplete or does not match its manifest."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def artifact_files(root: Path) -> list[Path]:
    """The files that make up an artifact (not its manifest, checkpoints or tracker logs)."""
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and rel.name != MANIFEST and not (set(rel.parts) & _IGNORED_DIRS):
            files.append(path)
    return files


def hash_files(root: Path) -> dict[str, str]:
    """``{relative path: sha256}`` for every artifact file under ``root``."""
    return {str(p.relative_to(root)): sha256_file(p) for p in artifact_files(root)}


def digest(files: dict[str, str]) -> str:
    """One sha256 naming a set of file hashes."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def config_hash(config: Any) -> str:
    """sha256 of a stage's resolved config (key order ignored): what decides "up to date"."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root`` and every directory (so new names are durable too)."""
    for path in sorted(root.rglob("*")):
        if path.is_file() or path.is_dir():
            fsync_path(path)
    fsync_path(root)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to a temporary file in the same directory, fsync it, then rename over ``path``.

    A reader sees the old file or the complete new one, never a truncated one; if the write
    fails (a full disk) the temporary file is removed and ``path`` is untouched.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2, sort_keys=True, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def manifest_shape_problem(data: Any) -> str | None:
    """What is wrong with the shape of a parsed manifest, or None if it is usable."""
    if not isinstance(data, dict):
        return f"expected a JSON object, got {type(data).__name__}"
    for key in ("stage", "id", "config_hash", "digest"):
        if not isinstance(data.get(key), str):
            return f"{key!r}: expected a string, got {type(data.get(key)).__name__}"
    files = data.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        return "'files': expected an object of file path to sha256"
    if bad := next((f for f in files if Path(f).is_absolute() or ".." in Path(f).parts), None):
        return f"'files': {bad!r} is not a path inside the artifact"
    inputs = data.get("inputs", [])
    if not isinstance(inputs, list) or not all(
        isinstance(i, dict) and all(isinstance(i.get(k), str) for k in ("role", "path", "sha256")) for i in inputs
    ):
        return "'inputs': expected a list of objects with string role, path and sha256"
    if not isinstance(data.get("metrics", {}), dict):
        return "'metrics': expected an object"
    return None


def read_manifest(root: Path) -> dict[str, Any] | None:
    """The manifest of an artifact directory, or None if it has none.

    A manifest that exists but cannot be read, is not JSON, or has the wrong shape raises
    :class:`ArtifactError` naming the file: treating it as absent would let the runner rebuild
    over (or hash as a plain directory) an artifact whose record was damaged.
    """
    path = root / MANIFEST
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise ArtifactError(f"{path}: unreadable ({exc.strerror or exc}); {_FIX}") from None
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: not valid JSON ({exc}); {_FIX}") from None
    if problem := manifest_shape_problem(data):
        raise ArtifactError(f"{path}: not a Warsha manifest ({problem}); {_FIX}")
    return data


def verify(root: Path) -> str:
    """Check every file against the manifest; return the artifact digest.

    Raises :class:`ArtifactError` naming the first file that is missing or changed, so a
    corrupt artifact is never loaded and never silently overwritten.
    """
    manifest = read_manifest(root)
    if manifest is None:
        raise ArtifactError(f"{root}: no {MANIFEST}; it is not a finished Warsha artifact")
    for rel, expected in manifest["files"].items():
        path = root / rel
        if not path.is_file():
            raise ArtifactError(f"{path}: listed in {MANIFEST} but missing; rerun the stage with --force")
        if sha256_file(path) != expected:
            raise ArtifactError(
                f"{path}: sha256 does not match {MANIFEST} (truncated or edited);"
                " restore it or rerun the stage with --force"
            )
    return manifest["digest"]


def external_digest(root: Path) -> str:
    """Digest of a directory that is not a Warsha artifact (a user's base model)."""
    if not root.is_dir():
        raise ArtifactError(f"{root}: no such model directory")
    return digest(hash_files(root))


def finalize(partial: Path, final: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Hash and fsync the files, write the manifest, and rename ``partial`` to ``final``.

    Until the rename nothing stands under the final name, so a killed run never leaves a
    half-written artifact that looks finished. A previous artifact is moved aside first and
    deleted only after the new one is in place. The caller deletes what it needs to resume the
    stage only after this returns: any failure in here (a kill, a full disk) leaves that intact.
    """
    fsync_tree(partial)
    files = hash_files(partial)
    manifest = {**manifest, "files": files, "digest": digest(files)}
    write_json_atomic(partial / MANIFEST, manifest)
    if final.exists():
        final.rename(final.with_name(f"{final.name}.old-{int(time.time() * 1000)}"))
    partial.rename(final)
    fsync_path(final.parent)
    # Also the copy moved aside by an earlier run that was killed between the two renames.
    for old in final.parent.glob(f"{glob.escape(final.name)}.old-*"):
        shutil.rmtree(old, ignore_errors=True)
    return manifest
