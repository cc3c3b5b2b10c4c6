"""wandb in offline mode: a run folder per stage, its id in the manifest, no network."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import tiny_recipe
from warsha import artifacts, pipeline
from warsha.config import parse_recipe
from warsha.tracking import flatten


def test_wandb_offline_run_recorded_in_manifest(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    data = tiny_recipe(steps=2)
    data["tracking"] = {"backend": "wandb", "mode": "offline", "project": "warsha-test"}
    recipe = parse_recipe(data)
    pipeline.Runner(recipe, tmp_path).run(pipeline.plan(recipe, tmp_path), {0})
    m = artifacts.read_manifest(tmp_path / "bootstrap")
    run_id = m["tracking"]["run_id"]
    assert m["tracking"]["backend"] == "wandb" and run_id
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))
    assert not (tmp_path / "bootstrap" / "wandb").exists(), "tracker logs stay out of the artifact"


def test_flatten_nested_metrics() -> None:
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a/b": 1, "a/c/d": 2, "e": 3}
