"""Recipes: the typed schema, YAML loading, ``key.sub=value`` overrides, and validation.

A recipe is validated completely before anything runs or is written: every problem is
collected with its path (``stages[2].params.factor: must be > 1, got 0.5``) and reported at
once, because a user who fixes one error only to meet the next wastes a cluster allocation.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from warsha.data import DataConfig
from warsha.schema import check, from_dict, ge, to_dict
from warsha.tracking import TrackingConfig

_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
MAX_NAME = 200


def dir_name_problem(value: str) -> str | None:
    """Why ``value`` cannot name a directory of a run (recipe names, stage ids), or None.

    Both become path components (``runs/<name>/<id>``); a separator or ``..`` would write
    outside the run directory, and a leading ``.`` would collide with the runner's own
    ``.<id>.partial`` and ``.<id>.checkpoints`` siblings.
    """
    if not _ID.fullmatch(value) or len(value) > MAX_NAME:
        return (
            f"{value!r} is not a valid directory name: use letters, digits, '_', '.' and '-', not starting"
            f" with '.' or '-', at most {MAX_NAME} characters (no '/', no '..')"
        )
    return None


class RecipeError(ValueError):
    """A recipe with one or more problems; ``problems`` lists each by its path."""

    def __init__(self, problems: list[str], source: str = "recipe") -> None:
        self.problems = problems
        super().__init__(f"{source}: {len(problems)} problem(s)\n" + "\n".join(f"  {p}" for p in problems))


@dataclass
class StageEntry:
    """One entry of ``stages:``: which stage, its id (directory name), inputs, params."""

    stage: str
    id: str | None = None
    inputs: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """The stage's id: its explicit ``id`` or the short stage name."""
        return self.id or self.stage.rpartition(".")[2]


@dataclass
class Recipe:
    """A whole pipeline: base model, data, tracking and the ordered stages."""

    name: str = field(metadata=check(dir_name_problem, help="names the run directory: runs/<name>"))
    base: str = field(default="bootstrap", metadata=check(help="local HF model dir, or 'bootstrap'"))
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = field(
        default=None, metadata=check(ge(1), help="CPU threads; OMP_NUM_THREADS wins, default: physical cores")
    )
    allocator: Literal["tcmalloc", "glibc-tuned", "system"] | None = field(
        default=None,
        metadata=check(help="C allocator; WARSHA_ALLOCATOR wins, default: tcmalloc if installed, else glibc-tuned"),
    )
    data: DataConfig = field(default_factory=DataConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    stages: list[StageEntry] = field(default_factory=list)
    # Filled by validation: the typed params object of each stage, in order.
    resolved: list[Any] = field(default_factory=list, repr=False)


def load_yaml(path: Path) -> dict[str, Any]:
    """Read a recipe file into plain data, with errors that name the file and line."""
    if not path.is_file():
        raise RecipeError([f"{path}: no such recipe file"], str(path))
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RecipeError([f"malformed YAML: {exc}"], str(path)) from None
    if not isinstance(data, dict):
        raise RecipeError([f"top level: expected a mapping, got {type(data).__name__}"], str(path))
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` / ``stages[2].params.x=1`` / ``stages.yarn.params.x=1`` overrides.

    Values are parsed as YAML, so ``train.steps=10`` is an int and ``tracking.backend=none``
    a string.
    """
    data = copy.deepcopy(data)
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            problems.append(f"override {item!r}: expected key.sub=value")
            continue
        try:
            _set_path(data, _split_key(key), yaml.safe_load(raw))
        except (KeyError, IndexError, TypeError) as exc:
            problems.append(f"override {key}: {exc}")
    if problems:
        raise RecipeError(problems, "overrides")
    return data


def _split_key(key: str) -> list[str | int]:
    parts: list[str | int] = []
    for token in key.split("."):
        m = re.fullmatch(r"([^\[\]]+)((?:\[\d+\])*)", token)
        if not m:
            raise KeyError(f"cannot parse {token!r}")
        parts.append(m.group(1))
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", m.group(2)))
    return parts


def _set_path(node: Any, parts: list[str | int], value: Any) -> None:
    for part in parts[:-1]:
        if isinstance(node, list) and isinstance(part, str):
            node = _stage_by_id(node, part)
            continue
        if isinstance(node, dict) and part not in node:
            node[part] = {}
        node = node[part]
    last = parts[-1]
    if isinstance(node, list) and isinstance(last, int) and last >= len(node):
        raise IndexError(f"index {last} out of range (list has {len(node)} items)")
    node[last] = value


def _stage_by_id(stages: list[Any], key: str) -> dict[str, Any]:
    for entry in stages:
        if isinstance(entry, dict):
            stage_id = entry.get("id") or str(entry.get("stage", "")).rpartition(".")[2]
            if stage_id == key:
                return entry
    raise KeyError(f"no stage with id {key!r}")


def parse_recipe(data: dict[str, Any], source: str = "recipe") -> Recipe:
    """Validate plain data into a :class:`Recipe`, raising one error listing every problem."""
    from warsha.registry import UnknownStage, get_stage, known_stages

    problems: list[str] = []
    recipe = from_dict(Recipe, data, "", problems)
    if recipe is None:
        raise RecipeError(problems, source)
    seen: dict[str, int] = {}
    recipe.resolved = []
    for i, entry in enumerate(recipe.stages or []):
        if entry is None:
            recipe.resolved.append(None)
            continue
        path = f"stages[{i}]"
        try:
            sdef = get_stage(entry.stage)
        except UnknownStage:
            problems.append(f"{path}.stage: unknown stage {entry.stage!r} (known: {', '.join(known_stages())})")
            recipe.resolved.append(None)
            continue
        recipe.resolved.append(from_dict(sdef.params, entry.params, f"{path}.params", problems))
        problems += _check_entry(entry, i, sdef.inputs, seen, recipe, sdef.optional_inputs)
        seen[entry.key] = i
    problems += _check_base(recipe)
    if not problems:
        problems += check_widths(recipe)
    if problems:
        raise RecipeError(problems, source)
    return recipe


def check_widths(recipe: Recipe) -> list[str]:
    """Walk the model widths through the stages (``warsha.widths``) and collect every stage's
    objection to its input's widths, so that a group size that cannot divide a model's linears
    fails here and not after the stages before it have run."""
    from warsha.registry import get_stage
    from warsha.stage import named_function
    from warsha.widths import Widths, from_model_dir

    by_key: dict[str, Widths | None] = {}
    prev = from_model_dir(Path(recipe.base)) if recipe.base != "bootstrap" else None
    problems: list[str] = []
    for i, (entry, params) in enumerate(zip(recipe.stages, recipe.resolved, strict=True)):
        sdef = get_stage(entry.stage)
        ref = entry.inputs.get("model")
        w_in = prev if ref is None else (by_key[ref] if ref in by_key else from_model_dir(Path(ref)))
        if sdef.check_widths and w_in is not None:
            problems += [f"stages[{i}].params.{p}" for p in named_function(sdef.check_widths)(params, w_in)]
        if sdef.widths:
            prev = named_function(sdef.widths)(params, w_in)
        else:
            prev = w_in if "model" in sdef.inputs else None
        by_key[entry.key] = prev
    return problems


def _check_entry(
    entry: StageEntry,
    i: int,
    roles: tuple[str, ...],
    seen: dict[str, int],
    recipe: Recipe,
    optional: tuple[str, ...] = (),
) -> list[str]:
    path = f"stages[{i}]"
    problems = []
    if problem := dir_name_problem(entry.key):
        problems.append(f"{path}.id: {problem}")
    if entry.key in seen:
        problems.append(f"{path}.id: {entry.key!r} is already used by stages[{seen[entry.key]}]; give one an id")
    for role, ref in entry.inputs.items():
        if role not in roles + optional:
            takes = ", ".join(roles + tuple(f"{r} (optional)" for r in optional)) or "none"
            problems.append(f"{path}.inputs.{role}: {entry.stage} takes no input {role!r} (takes: {takes})")
        elif ref not in seen and not Path(ref).is_dir():
            problems.append(f"{path}.inputs.{role}: {ref!r} is neither an earlier stage id nor a directory")
    for role in roles:
        if role != "model" and role not in entry.inputs:
            problems.append(f"{path}.inputs.{role}: required (an earlier stage id or a directory)")
    if "model" in roles and "model" not in entry.inputs and not seen and recipe.base == "bootstrap":
        problems.append(f"{path}: needs a model but no earlier stage makes one; set base: or add a bootstrap stage")
    return problems


def _check_base(recipe: Recipe) -> list[str]:
    if recipe.base == "bootstrap":
        return []
    base = Path(recipe.base)
    if not base.is_dir():
        return [f"base: no such model directory {recipe.base!r} (a local HF model dir, or 'bootstrap')"]
    if not (base / "config.json").is_file():
        return [f"base: {recipe.base!r} has no config.json; it is not an HF model directory"]
    return []


_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(node: Any) -> Any:
    """Expand ``${VAR}`` and ``${VAR:-default}`` in every string, so one recipe serves every
    cluster: model and data paths come from the environment (``WARSHA_MODELS=/shared/models``)."""
    if isinstance(node, dict):
        return {k: expand_env(v) for k, v in node.items()}
    if isinstance(node, list):
        return [expand_env(v) for v in node]
    if isinstance(node, str):
        return _ENV.sub(
            lambda m: os.environ.get(m.group(1), m.group(2) if m.group(2) is not None else m.group(0)), node
        )
    return node


def load_recipe(path: Path, overrides: list[str] | None = None) -> Recipe:
    """Load, expand environment variables, override and validate a recipe file."""
    data = apply_overrides(expand_env(load_yaml(path)), overrides or [])
    return parse_recipe(data, str(path))


def stage_config(recipe: Recipe, index: int) -> dict[str, Any]:
    """The resolved config of one stage, as hashed and written into its manifest."""
    entry = recipe.stages[index]
    return {
        "stage": entry.stage,
        "id": entry.key,
        "params": to_dict(recipe.resolved[index]),
        "inputs": dict(entry.inputs),
        "seed": recipe.seed,
        "data": to_dict(recipe.data),
    }


def recipe_dict(recipe: Recipe) -> dict[str, Any]:
    """Plain-data form of a validated recipe (without the resolved params cache)."""
    d = to_dict(dataclasses.replace(recipe, resolved=[]))
    d.pop("resolved", None)
    return d
