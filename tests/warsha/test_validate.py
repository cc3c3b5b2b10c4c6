"""serve.validate drives the bundled engine with a target and a draft from disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import tiny_recipe
from warsha import artifacts, pipeline
from warsha.config import parse_recipe


def test_validate_stage_with_self_draft(tiny_artifact: Path, tmp_path: Path) -> None:
    data = tiny_recipe()
    data["base"] = str(tiny_artifact)
    data["stages"] = [{"stage": "serve.validate", "inputs": {"draft": str(tiny_artifact)},
                       "params": {"num_prompts": 3, "prompt_tokens": 8, "max_tokens": 12,
                                  "num_speculative_tokens": 3, "batch_sizes": [1, 3]}}]
    recipe = parse_recipe(data)
    pipeline.Runner(recipe, tmp_path).run(pipeline.plan(recipe, tmp_path), {0})
    m = artifacts.read_manifest(tmp_path / "validate")["metrics"]
    assert m["outputs_match"] is True
    for bs in (1, 3):
        spec = m[f"batch{bs}"]["speculative"]
        # The draft is the target itself: every greedy proposal must be accepted.
        assert spec["acceptance_rate"] == pytest.approx(1.0)
        assert spec["mean_accepted_length"] == pytest.approx(4.0, abs=0.5)
        assert m[f"batch{bs}"]["plain"]["ttft_p50"] > 0 and spec["tpot_p50"] > 0
    assert (tmp_path / "validate" / "serve_validate.md").is_file()


def test_validate_requires_a_draft_input() -> None:
    from warsha.config import RecipeError

    data = tiny_recipe()
    data["stages"].append({"stage": "serve.validate"})
    with pytest.raises(RecipeError, match=r"stages\[1\].inputs.draft: required"):
        parse_recipe(data)
