"""No crash may lose work: a fault, a full disk or a kill -9 during finalize leaves a run that
resumes from its last checkpoint and ends with the weights of an uninterrupted run; damaged
manifests and checkpoint files are reported or ignored, never trusted."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, tiny_recipe
from warsha import artifacts, pipeline
from warsha.cli import main
from warsha.config import parse_recipe
from warsha.training import STEP_FILE, read_step_file

# The tiny recipe trains 4 steps and checkpoints every 2 (never at the last step): a stage that
# fails after training resumes from step 2 and runs steps 2 and 3 again.
LAST_CHECKPOINT = 2


def run_tiny(root: Path) -> pipeline.Planned:
    recipe = parse_recipe(tiny_recipe())
    steps = pipeline.plan(recipe, root)
    return pipeline.Runner(recipe, root).run(steps, {0})[0]


def assert_resumable(root: Path) -> None:
    """What a failed finalize must leave: no artifact, the checkpoint and its resume marker."""
    assert not (root / "bootstrap").exists()
    ckpt = pipeline.checkpoint_dir(root / "bootstrap")
    assert (ckpt / pipeline.RESUME_MARK).is_file()
    assert read_step_file(ckpt / "bootstrap" / f"step-{LAST_CHECKPOINT}") is not None


def assert_resumed_to_reference(root: Path, reference: Path) -> None:
    """Rerun: the stage resumes from its last checkpoint and ends with the reference weights."""
    from safetensors.torch import load_file

    step = run_tiny(root)
    assert step.status == "ran"
    assert step.metrics["train"]["resumed_from_step"] == LAST_CHECKPOINT
    assert step.metrics["train"]["steps_run"] == 4 - LAST_CHECKPOINT
    artifacts.verify(root / "bootstrap")
    want, got = load_file(reference / "model.safetensors"), load_file(root / "bootstrap" / "model.safetensors")
    assert want.keys() == got.keys()
    assert all(got[k].equal(want[k]) for k in want), "resumed weights differ from an uninterrupted run's"
    assert not pipeline.checkpoint_dir(root / "bootstrap").exists()
    assert not pipeline.partial_dir(root / "bootstrap").exists()


def test_fault_between_manifest_write_and_rename_resumes(
    tmp_path: Path, tiny_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_rename = Path.rename

    def rename(self: Path, target: Any) -> Path:
        if self.name == ".bootstrap.partial":
            raise OSError(errno.EIO, "injected fault at the final rename")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match="injected fault"):
        run_tiny(tmp_path)
    monkeypatch.undo()
    partial_manifest = artifacts.read_manifest(pipeline.partial_dir(tmp_path / "bootstrap"))
    assert partial_manifest is not None, "the fault must come after the manifest was written"
    assert_resumable(tmp_path)
    assert_resumed_to_reference(tmp_path, tiny_artifact)


class FullDisk:
    """A file object whose writes fail as on a full disk."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh

    def write(self, data: str) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fh, name)

    def __enter__(self) -> FullDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.fh.close()


def test_full_disk_during_finalize_resumes(
    tmp_path: Path, tiny_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_finalize, real_fdopen = artifacts.finalize, os.fdopen

    def finalize_on_full_disk(partial: Path, final: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        monkeypatch.setattr(os, "fdopen", lambda *a, **k: FullDisk(real_fdopen(*a, **k)))
        return real_finalize(partial, final, manifest)

    monkeypatch.setattr(artifacts, "finalize", finalize_on_full_disk)
    with pytest.raises(OSError) as info:
        run_tiny(tmp_path)
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC
    partial = pipeline.partial_dir(tmp_path / "bootstrap")
    assert not list(partial.glob("*warsha.json*")), "a failed manifest write must leave no manifest or temp file"
    assert_resumable(tmp_path)
    assert_resumed_to_reference(tmp_path, tiny_artifact)


# Runs the CLI with a real SIGKILL between the manifest write and the final rename.
KILL_AT_RENAME = """
import os, signal, sys
from pathlib import Path
real = Path.rename
def rename(self, target):
    if self.name.endswith(".partial") and (self / "warsha.json").is_file():
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, target)
Path.rename = rename
from warsha.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_kill_9_during_finalize_then_rerun_resumes(tmp_path: Path) -> None:
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(yaml.safe_dump(tiny_recipe()))
    args = ["run", str(recipe_path), "--out", str(tmp_path / "out")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    killed = subprocess.run([sys.executable, "-c", KILL_AT_RENAME, *args], env=env, capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert_resumable(tmp_path / "out")
    done = subprocess.run([sys.executable, "-m", "warsha", *args], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    train = artifacts.read_manifest(tmp_path / "out" / "bootstrap")["metrics"]["train"]
    assert train["resumed_from_step"] == LAST_CHECKPOINT and train["steps_run"] == 4 - LAST_CHECKPOINT
    assert not pipeline.checkpoint_dir(tmp_path / "out" / "bootstrap").exists()


def test_checkpoint_counts_only_once_complete(tmp_path: Path) -> None:
    def make(name: str, text: str | None) -> Path:
        d = tmp_path / name
        d.mkdir()
        if text is not None:
            (d / STEP_FILE).write_text(text)
        return d

    assert read_step_file(make("step-4", json.dumps({"step": 4, "evals": []}))) == {"step": 4, "evals": []}
    assert read_step_file(make("step-6.tmp", json.dumps({"step": 6}))) is None  # a save that was not renamed
    assert read_step_file(make("step-8", None)) is None  # killed before the step file
    assert read_step_file(make("step-10", '{"step": 1')) is None  # truncated step file
    assert read_step_file(make("step-12", json.dumps({"step": 2}))) is None  # names another step
    assert read_step_file(make("step-14", "[14]")) is None


def test_failed_json_write_leaves_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "state.json"
    artifacts.write_json_atomic(path, {"step": 2})
    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda *a, **k: FullDisk(real_fdopen(*a, **k)))
    with pytest.raises(OSError, match="No space left"):
        artifacts.write_json_atomic(path, {"step": 4})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"step": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


GOOD = {"stage": "bootstrap", "id": "bootstrap", "config_hash": "0" * 64, "digest": "1" * 64, "files": {}}


@pytest.mark.parametrize(
    "content, what",
    [
        ("{not json", "not valid JSON"),
        (b"\x80\x81 not utf-8", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        (json.dumps({**GOOD, "files": ["model.safetensors"]}), "'files'"),
        (json.dumps({**GOOD, "files": {"../../etc/passwd": "0" * 64}}), "not a path inside the artifact"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "digest"}), "'digest'"),
        (json.dumps({**GOOD, "inputs": [{"role": "model"}]}), "'inputs'"),
        (None, "unreadable (Is a directory)"),
    ],
)
def test_bad_manifest_is_an_error_naming_the_file(
    tmp_path: Path, content: str | bytes | None, what: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "out"
    manifest = run_dir / "bootstrap" / artifacts.MANIFEST
    manifest.parent.mkdir(parents=True)
    if content is None:
        manifest.mkdir()
    elif isinstance(content, bytes):
        manifest.write_bytes(content)
    else:
        manifest.write_text(content)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe()))
    for argv in (
        ["inspect", str(manifest.parent)],
        ["report", str(run_dir)],
        ["run", str(recipe), "--out", str(run_dir)],
        ["run", str(recipe), "--out", str(run_dir), "--dry-run"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"error: {manifest}: ") and what in err and "; restore it" in err, (argv, err)
    assert manifest.exists(), "a damaged artifact must not be rebuilt over without --force"


def test_up_to_date_stage_drops_checkpoints_left_after_its_rename(tmp_path: Path, tiny_artifact: Path) -> None:
    """A kill after the rename but before the checkpoints were deleted: the rerun skips the
    stage and deletes them; checkpoints of another job are kept."""
    import shutil

    shutil.copytree(tiny_artifact, tmp_path / "bootstrap")
    recipe = parse_recipe(tiny_recipe())
    (step,) = pipeline.plan(recipe, tmp_path)
    ckpt = pipeline.checkpoint_dir(tmp_path / "bootstrap")
    artifacts.write_json_atomic(ckpt / pipeline.RESUME_MARK, {"config_hash": "another job", "inputs": {}})
    pipeline.Runner(recipe, tmp_path).run([step], {0})
    assert step.status == "skipped (up to date)" and ckpt.exists()
    artifacts.write_json_atomic(ckpt / pipeline.RESUME_MARK, {"config_hash": step.config_hash, "inputs": {}})
    pipeline.Runner(recipe, tmp_path).run([step], {0})
    assert step.status == "skipped (up to date)" and not ckpt.exists()
