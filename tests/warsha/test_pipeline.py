"""The artifact contract: HF-loadable output, manifest, skip on rerun, corruption, kill -9 resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import tiny_recipe
from warsha import artifacts, pipeline
from warsha.config import parse_recipe
from warsha.training import read_step_file


def test_artifact_loads_with_auto_classes_and_has_manifest(tiny_artifact: Path) -> None:
    import sentencepiece as spm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "warsha.json",
    ):
        assert (tiny_artifact / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(tiny_artifact)
    tok = AutoTokenizer.from_pretrained(tiny_artifact)
    sp = spm.SentencePieceProcessor(model_file=str(tiny_artifact / "tokenizer.model"))
    text = "Narrated Anas: The Prophet said,  قال رسول الله"
    assert tok(text, add_special_tokens=False).input_ids == sp.encode(text)
    out = model.generate(**tok("The Prophet", return_tensors="pt"), max_new_tokens=5, do_sample=False)
    assert out.shape[1] > 3
    m = artifacts.read_manifest(tiny_artifact)
    assert m["stage"] == "bootstrap" and len(m["config_hash"]) == 64
    assert m["inputs"] == [] and "model.safetensors" in m["files"]
    assert {"torch", "transformers", "python"} <= set(m["versions"])
    assert m["metrics"]["train"]["steps_run"] == 4
    assert m["metrics"]["en"]["bits_per_char"] > 0
    assert artifacts.verify(tiny_artifact) == m["digest"]


def run_tiny(root: Path, force: bool = False, **kw) -> list[pipeline.Planned]:
    recipe = parse_recipe(tiny_recipe(**kw))
    steps = pipeline.plan(recipe, root)
    return pipeline.Runner(recipe, root, force=force).run(steps, {0})


def test_rerun_skips_and_config_change_reruns(tmp_path: Path) -> None:
    assert run_tiny(tmp_path, steps=2)[0].status == "ran"
    first = artifacts.read_manifest(tmp_path / "bootstrap")
    assert run_tiny(tmp_path, steps=2)[0].status == "skipped (up to date)"
    assert artifacts.read_manifest(tmp_path / "bootstrap")["created"] == first["created"]
    assert run_tiny(tmp_path, steps=2, force=True)[0].status == "ran"
    assert run_tiny(tmp_path, steps=3)[0].status == "ran"
    assert not list(tmp_path.glob(".bootstrap.*")) and not list(tmp_path.glob("*.old-*"))


def test_corrupted_weights_detected_and_not_overwritten(tmp_path: Path) -> None:
    run_tiny(tmp_path, steps=2)
    weights = tmp_path / "bootstrap" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(artifacts.ArtifactError, match="sha256 does not match"):
        run_tiny(tmp_path, steps=2)
    assert weights.read_bytes() == data[: len(data) // 2]
    proc = subprocess.run(
        [sys.executable, "-m", "warsha", "inspect", str(tmp_path / "bootstrap"), "--verify"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "model.safetensors" in proc.stderr


def test_kill_during_training_then_resume(tmp_path: Path) -> None:
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(yaml.safe_dump(tiny_recipe(steps=40)))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "warsha", "run", str(recipe_path), "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ckpt = pipeline.checkpoint_dir(out / "bootstrap") / "bootstrap"
    deadline = time.time() + 240
    while time.time() < deadline and not any(read_step_file(d) for d in ckpt.glob("step-*")):  # complete only
        assert proc.poll() is None, "run ended before it could be killed"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "bootstrap").exists(), "a killed run must not leave an artifact under the final name"
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    m = artifacts.read_manifest(out / "bootstrap")
    assert m["metrics"]["train"]["resumed_from_step"] > 0
    assert m["metrics"]["train"]["steps_run"] == 40 - m["metrics"]["train"]["resumed_from_step"]
    assert not (out / ".bootstrap.partial").exists() and not pipeline.checkpoint_dir(out / "bootstrap").exists()


def test_only_and_from_selection(tmp_path: Path) -> None:
    recipe = parse_recipe(tiny_recipe())
    steps = pipeline.plan(recipe, tmp_path)
    assert pipeline.select_stages(steps, None, "bootstrap") == {0}
    with pytest.raises(ValueError, match="no stage 'yarn'"):
        pipeline.select_stages(steps, "yarn", None)


def test_manifest_write_is_atomic(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    artifacts.write_json_atomic(path, {"a": 1})
    artifacts.write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]
