"""The contract between the pipeline runner and a stage.

A stage package (``tokenizer_ext``, ``context_ext``, ...) exposes a module ``<package>.stages``
with a ``STAGES`` dict of :class:`StageDef`. That module must import fast (dataclasses and this
file only; heavy libraries are imported inside ``run``), because the runner imports it to
validate a recipe in well under a second. The runner owns directories, manifests, hashing,
skipping and resuming; a stage only reads ``ctx.inputs`` and writes into ``ctx.out_dir``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from warsha.config import Recipe
    from warsha.data import Corpus
    from warsha.tracking import Tracker


@dataclass(frozen=True)
class StageDef:
    """A registered stage: its full name, parameter dataclass and entry point.

    ``entry`` is ``"module:function"``, imported only when the stage runs: a ``stages`` module
    never imports the code that does the work, so validating a recipe stays fast and no stage
    package has an import cycle between its registry and its implementation.

    ``inputs`` names the artifact roles the stage reads (``model`` is the previous stage's
    output unless the recipe maps it elsewhere); an empty tuple means the stage creates a model
    from nothing (``bootstrap``). ``optional_inputs`` are roles a recipe may map; when mapped
    they are hashed into the skip decision like any input. ``training`` stages get a resumable
    checkpoint directory.

    ``widths`` and ``check_widths`` are optional ``"module:function"`` hooks run at planning
    (light imports only, see ``warsha.widths``): ``widths(params, input_widths)`` gives the
    output model's widths for a stage that changes them (default: a stage with a ``model``
    input passes its widths through; one without knows none), and
    ``check_widths(params, input_widths)`` returns ``"field: problem"`` lines for widths the
    stage cannot handle, so the recipe fails before any stage runs.
    """

    name: str
    params: type
    entry: str
    description: str
    inputs: tuple[str, ...] = ("model",)
    optional_inputs: tuple[str, ...] = ()
    training: bool = False
    uses_data: bool = True
    widths: str = ""
    check_widths: str = ""

    def run(self, ctx: "StageContext", params: Any) -> dict[str, Any]:
        """Import the entry point and run it."""
        return self.entry_point()(ctx, params)

    def entry_point(self) -> Callable[["StageContext", Any], dict[str, Any]]:
        """The function named by ``entry``."""
        return named_function(self.entry)


def named_function(spec: str) -> Callable[..., Any]:
    """The function a ``"module:function"`` string names (imported now)."""
    module, _, func = spec.partition(":")
    return getattr(importlib.import_module(module), func)


@dataclass
class StageContext:
    """Everything a stage may use; built by the pipeline, one per stage run.

    ``out_dir`` is the temporary sibling the runner later renames into place: write only
    there, and only on the main process (``ctx.is_main``); it starts empty on every attempt.
    ``checkpoint_dir`` is a second sibling that survives a killed or failed run (finalize
    included) and is deleted only once the artifact is in place: keep everything a rerun
    should not redo there, which is how training stages resume.
    """

    stage: str
    stage_id: str
    recipe: "Recipe"
    out_dir: Path
    inputs: dict[str, Path]
    input_manifests: dict[str, dict[str, Any] | None]
    checkpoint_dir: Path
    tracker: "Tracker"
    device: str
    seed: int
    is_main: bool = True
    world_size: int = 1
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("warsha"))
    _corpus: "Corpus | None" = None

    def corpus(self) -> "Corpus":
        """The recipe's corpus, loaded once per process and shared by the stage's code."""
        if self._corpus is None:
            from warsha.data import load_corpus

            self._corpus = load_corpus(self.recipe.data, seed=self.recipe.seed)
        return self._corpus

    @property
    def model_dir(self) -> Path:
        """The ``model`` input: the artifact this stage transforms."""
        return self.inputs["model"]
