"""Check a served model directory against its `warsha.json` manifest before loading it.

Warsha's pipeline writes `warsha.json` into every artifact it finalises: `{"files": {relative
path: sha256 hex}, "digest": ...}`. Serving a directory whose weights were truncated, edited or
swapped would answer with a different model than the one that was evaluated, so `serve` checks
every listed file's sha256 and refuses files the engine would read (weights, JSON configs,
chat templates) that the manifest does not list. The manifest is read as plain JSON: `serve`
does not import `warsha`. A directory without a manifest is served unchecked.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "warsha.json"
LOADED_SUFFIXES = (".safetensors", ".json", ".jinja")


class ManifestError(ValueError):
    """The directory does not match its manifest (or the manifest is malformed)."""


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_file_hashes(root: Path) -> dict[str, str] | None:
    """The manifest's `{path: sha256}`; None without a manifest; ManifestError if it is malformed."""
    path = root / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path}: not readable JSON ({exc}); restore it or serve with --no-verify") from exc
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise ManifestError(f"{path}: expected an object with 'files': {{path: sha256}}; serve with --no-verify")
    return files


def verify_dir(root: Path) -> int:
    """Check `root` against its manifest; the number of files verified (0 without a manifest)."""
    files = read_file_hashes(root)
    if files is None:
        return 0
    for rel, expected in files.items():
        path = root / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ManifestError(f"{root / MANIFEST}: lists {rel!r}, which points outside the directory")
        if not path.is_file():
            raise ManifestError(f"{path}: listed in {MANIFEST} but missing; restore the file or re-run the stage")
        if _sha256(path) != expected:
            raise ManifestError(
                f"{path}: sha256 does not match {MANIFEST} (truncated or edited); re-run the stage that wrote it"
            )
    for path in sorted(root.iterdir()):
        if path.is_file() and path.name != MANIFEST and path.suffix in LOADED_SUFFIXES and path.name not in files:
            raise ManifestError(
                f"{path}: not listed in {MANIFEST}, but the engine would load it; remove it, or serve with --no-verify"
            )
    return len(files)
