"""Slow: the default bootstrap model really learns English (run with `make test-slow`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO
from warsha import artifacts, pipeline
from warsha.config import load_recipe


@pytest.mark.slow
def test_default_bootstrap_beats_unigram_and_writes_english(tmp_path: Path) -> None:
    recipe = load_recipe(REPO / "recipes" / "arabic-tiny.yaml", ["tracking.backend=none"])
    steps = pipeline.plan(recipe, tmp_path)
    pipeline.Runner(recipe, tmp_path).run(steps, pipeline.select_stages(steps, None, "bootstrap"))
    m = artifacts.read_manifest(tmp_path / "bootstrap")["metrics"]
    assert m["en"]["bits_per_char"] < 0.8 * m["en"]["unigram_bits_per_char"]
    words = m["sample"].split()
    common = {"the", "and", "of", "to", "he", "said", "was", "that", "in", "Allah", "a"}
    assert sum(w.strip(",.:'\"") in common for w in words) >= 3, m["sample"]
