"""Runs a recipe's stages: artifact directories, manifests, skipping, resuming, rank-0 writing.

Each stage writes into a temporary sibling (``.<id>.partial``) that the runner renames into
place once the manifest is written. Whatever lets a stage resume (the Trainer's checkpoints,
finished sub-runs, cached evaluations) lives in a second sibling, ``.<id>.checkpoints``, with a
resume marker naming the config hash and input digests it belongs to. That directory is
deleted only after the manifest is written and the rename has succeeded, so a kill or a full
disk at any point before, finalize included, leaves a run that resumes from its last
checkpoint. A rerun skips a stage whose manifest records the same config hash and the same
input digests.
"""

from __future__ import annotations

import json
import logging
import platform
import shutil
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from warsha import artifacts, distributed, runtime, tokenizer_files
from warsha.config import Recipe, recipe_dict, stage_config
from warsha.registry import get_stage
from warsha.stage import StageContext, StageDef
from warsha.tracking import make_tracker

log = logging.getLogger("warsha.pipeline")
VERSIONED = (
    "torch",
    "transformers",
    "tokenizers",
    "peft",
    "accelerate",
    "bitsandbytes",
    "deepspeed",
    "sentencepiece",
    "safetensors",
    "triton",
    "warsha",
)
RESUME_MARK = "warsha_resume.json"


@dataclass
class Planned:
    """One stage of a recipe, resolved to directories and a config hash."""

    index: int
    stage: str
    key: str
    sdef: StageDef
    params: Any
    out_dir: Path
    inputs: dict[str, Path]
    config: dict[str, Any]
    config_hash: str
    status: str = "pending"
    metrics: dict[str, Any] = field(default_factory=dict)


def partial_dir(out_dir: Path) -> Path:
    """Where a stage writes its artifact before the rename into ``out_dir``."""
    return out_dir.with_name(f".{out_dir.name}.partial")


def checkpoint_dir(out_dir: Path) -> Path:
    """Where a stage keeps what it needs to resume; outlives ``partial_dir`` until the rename."""
    return out_dir.with_name(f".{out_dir.name}.checkpoints")


def _read_mark(ckpt: Path) -> Any:
    try:
        return json.loads((ckpt / RESUME_MARK).read_text())
    except (OSError, ValueError):
        return None


def out_root(recipe: Recipe, out: Path | None) -> Path:
    """``runs/<recipe name>`` unless ``--out`` says otherwise."""
    return out if out is not None else Path("runs") / recipe.name


def plan(recipe: Recipe, root: Path) -> list[Planned]:
    """Resolve every stage's input directories, output directory and config hash."""
    steps: list[Planned] = []
    by_key: dict[str, Path] = {}
    for i, entry in enumerate(recipe.stages):
        sdef = get_stage(entry.stage)
        inputs: dict[str, Path] = {}
        for role in sdef.inputs + sdef.optional_inputs:
            ref = entry.inputs.get(role)
            if ref is not None:
                inputs[role] = by_key.get(ref, Path(ref))
            elif role == "model":
                inputs[role] = steps[-1].out_dir if steps else Path(recipe.base)
        cfg = stage_config(recipe, i)
        chash = artifacts.config_hash(cfg)
        out_dir = root / entry.key
        steps.append(Planned(i, entry.stage, entry.key, sdef, recipe.resolved[i], out_dir, inputs, cfg, chash))
        by_key[entry.key] = out_dir
    return steps


class Runner:
    """Executes a plan. ``select`` limits which stages may run (``--from`` / ``--only``)."""

    def __init__(self, recipe: Recipe, root: Path, force: bool = False) -> None:
        self.recipe = recipe
        self.root = root
        self.force = force
        self._digests: dict[Path, str] = {}

    def input_digest(self, path: Path) -> str:
        """Digest of an input: verified against its manifest if it is a Warsha artifact."""
        path = path.resolve()
        if path not in self._digests:
            if artifacts.read_manifest(path) is not None:
                self._digests[path] = artifacts.verify(path)
            elif partial_dir(path).exists() or checkpoint_dir(path).exists() or not path.exists():
                raise artifacts.ArtifactError(
                    f"{path}: this input has not been produced yet; run its stage first (drop --only/--from)"
                )
            else:
                self._digests[path] = artifacts.external_digest(path)
        return self._digests[path]

    def up_to_date(self, step: Planned, digests: dict[str, str]) -> bool:
        """Whether ``step``'s artifact matches its config and inputs (and its own files)."""
        manifest = artifacts.read_manifest(step.out_dir)
        if manifest is None or manifest.get("config_hash") != step.config_hash:
            return False
        if {i["role"]: i["sha256"] for i in manifest.get("inputs", [])} != digests:
            return False
        self._digests[step.out_dir.resolve()] = artifacts.verify(step.out_dir)
        return True

    def run(self, steps: list[Planned], select: set[int]) -> list[Planned]:
        """Run the selected stages in order, skipping those already up to date."""
        runtime.apply(self.recipe.allocator, self.recipe.threads)  # before the first tensor
        distributed.init(self.recipe.device)
        for step in steps:
            if step.index not in select:
                step.status = "not selected"
                continue
            digests = {role: self.input_digest(p) for role, p in step.inputs.items()}
            if not self.force and self.up_to_date(step, digests):
                step.status = "skipped (up to date)"
                step.metrics = (artifacts.read_manifest(step.out_dir) or {}).get("metrics", {})
                self._drop_finished_checkpoints(step, digests)
                log.info("[%d/%d] %s (%s): up to date, skipped", step.index + 1, len(steps), step.stage, step.key)
                continue
            self._execute(step, digests, len(steps))
        return steps

    def _execute(self, step: Planned, digests: dict[str, str], total: int) -> None:
        log.info("[%d/%d] %s (%s): running -> %s", step.index + 1, total, step.stage, step.key, step.out_dir)
        partial, ckpt = self._prepare(step, digests)
        is_main = distributed.is_main()
        tracker = make_tracker(self.recipe.tracking, is_main)
        tracker.start(
            f"{self.recipe.name}/{step.key}",
            self.recipe.name,
            {"stage": step.config, "recipe": recipe_dict(self.recipe)},
            self.root,
        )
        ctx = StageContext(
            stage=step.stage,
            stage_id=step.key,
            recipe=self.recipe,
            out_dir=partial,
            inputs=step.inputs,
            input_manifests={r: artifacts.read_manifest(p) for r, p in step.inputs.items()},
            checkpoint_dir=ckpt,
            tracker=tracker,
            device=self.recipe.device,
            seed=self.recipe.seed,
            is_main=is_main,
            world_size=distributed.world_size(),
        )
        t0, cpu0 = time.perf_counter(), runtime.cpu_seconds()
        metrics = step.sdef.run(ctx, step.params) or {}
        wall, cpu = time.perf_counter() - t0, runtime.cpu_since(cpu0)
        tracker.finish(metrics)
        if is_main:
            manifest = self._manifest(step, digests, metrics, wall, tracker.run_id)
            manifest["cpu_time"] = cpu
            if (partial / "config.json").is_file():
                manifest["chat"] = chat_record(step, partial)
            artifacts.finalize(partial, step.out_dir, manifest)
            # Only now: had finalize failed, the rerun would need these to resume.
            shutil.rmtree(ckpt, ignore_errors=True)
        distributed.barrier()
        self._digests.pop(step.out_dir.resolve(), None)
        step.status, step.metrics = "ran", metrics
        log.info(
            "[%d/%d] %s (%s): done in %.1f s (CPU user %.1f s, sys %.1f s)",
            *(step.index + 1, total, step.stage, step.key, wall, cpu["user_s"], cpu["sys_s"]),
        )

    def _prepare(self, step: Planned, digests: dict[str, str]) -> tuple[Path, Path]:
        """A fresh partial directory, and the checkpoint directory: kept only for the same job.

        The partial directory is always emptied: a stage regenerates its outputs, and a
        leftover from a killed attempt (a half-written weight file, a manifest written just
        before a failed rename) must not end up in the artifact.
        """
        partial, ckpt = partial_dir(step.out_dir), checkpoint_dir(step.out_dir)
        job = {"config_hash": step.config_hash, "inputs": digests}
        if distributed.is_main():
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir(parents=True)
            if not self.force and _read_mark(ckpt) == job:
                log.info("%s: resuming from %s", step.key, ckpt)
            else:
                if ckpt.exists():
                    shutil.rmtree(ckpt)
                ckpt.mkdir(parents=True)
                artifacts.write_json_atomic(ckpt / RESUME_MARK, job)
        distributed.barrier()
        return partial, ckpt

    def _drop_finished_checkpoints(self, step: Planned, digests: dict[str, str]) -> None:
        """Checkpoints left by a run killed after its rename: the artifact they built is done.

        Checkpoints of another job (a different config that was interrupted) are kept for when
        that config runs again.
        """
        ckpt = checkpoint_dir(step.out_dir)
        if distributed.is_main() and _read_mark(ckpt) == {"config_hash": step.config_hash, "inputs": digests}:
            shutil.rmtree(ckpt, ignore_errors=True)

    def _manifest(
        self, step: Planned, digests: dict[str, str], metrics: dict[str, Any], wall: float, run_id: str | None
    ) -> dict[str, Any]:
        return {
            "stage": step.stage,
            "id": step.key,
            "recipe": self.recipe.name,
            "config": step.config,
            "config_hash": step.config_hash,
            "inputs": [{"role": r, "path": str(p), "sha256": digests[r]} for r, p in step.inputs.items()],
            "metrics": metrics,
            "versions": package_versions(),
            "wall_time_s": round(wall, 3),
            "tracking": {"backend": self.recipe.tracking.backend, "run_id": run_id},
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "world_size": distributed.world_size(),
            "runtime": runtime.describe(),
        }


def chat_record(step: Planned, out_dir: Path) -> dict[str, Any]:
    """The artifact's chat setup for its manifest (``warsha.tokenizer_files.chat_setup``), with a
    warning when an input model had a chat template and this artifact lost it: an instruct model
    without its template no longer answers ``/v1/chat/completions``."""
    record = tokenizer_files.chat_setup(out_dir)
    had = [r for r, p in step.inputs.items() if tokenizer_files.chat_template(p) is not None]
    if had and not record["chat_template"]:
        log.warning("%s: input %s has a chat template and this artifact has none", step.key, ", ".join(had))
    return record


def package_versions() -> dict[str, str]:
    """Installed versions of the packages that decide what a stage computes."""
    out = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def select_stages(steps: list[Planned], from_stage: str | None, only: str | None) -> set[int]:
    """Indices allowed to run under ``--from`` / ``--only`` (by id or stage name)."""

    def find(name: str) -> int:
        for s in steps:
            if name in (s.key, s.stage):
                return s.index
        raise ValueError(f"no stage {name!r} in this recipe (ids: {', '.join(s.key for s in steps)})")

    if only is not None:
        return {find(only)}
    start = find(from_stage) if from_stage is not None else 0
    return {s.index for s in steps if s.index >= start}


def check_writable(root: Path) -> None:
    """Fail before any work if the output directory cannot be created or written."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / ".warsha_write_probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise PermissionError(f"--out {root}: not writable ({exc.strerror}); choose another directory") from None
