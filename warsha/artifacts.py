"""Artifact directories: atomic writes, sha256, the ``warsha.json`` manifest, verification.

An artifact is an HF-format model directory plus ``warsha.json``. The manifest lists every
file's sha256, so a truncated or edited weight file is caught before a later stage uses it,
and the artifact's digest (a hash of that list) is what downstream manifests record as their
input: a change anywhere upstream makes every dependent stage rerun.
"""

from __future__ import annotations

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


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to a temporary file in the same directory, then rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=True, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_manifest(root: Path) -> dict[str, Any] | None:
    """The manifest of an artifact directory, or None if it has none (or it is unreadable)."""
    try:
        return json.loads((root / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def verify(root: Path) -> str:
    """Check every file against the manifest; return the artifact digest.

    Raises :class:`ArtifactError` naming the first file that is missing or changed, so a
    corrupt artifact is never loaded and never silently overwritten.
    """
    manifest = read_manifest(root)
    if manifest is None:
        raise ArtifactError(f"{root}: no readable {MANIFEST}; it is not a finished Warsha artifact")
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
    """Hash the files, write the manifest, and rename ``partial`` to ``final`` in one step.

    Until the rename nothing stands under the final name, so a killed run never leaves a
    half-written artifact that looks finished. A previous artifact is moved aside first and
    deleted only after the new one is in place.
    """
    shutil.rmtree(partial / "checkpoints", ignore_errors=True)
    files = hash_files(partial)
    manifest = {**manifest, "files": files, "digest": digest(files)}
    write_json_atomic(partial / MANIFEST, manifest)
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}.old-{int(time.time() * 1000)}")
        final.rename(old)
    partial.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return manifest
