"""Run tracking behind one small interface: wandb (offline by default) or nothing.

Offline is the default because most clusters Warsha runs on reach no tracking server; an
offline run folder syncs later with ``wandb sync``. Only the main process tracks.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger("warsha.tracking")


@dataclass
class TrackingConfig:
    """The recipe's ``tracking:`` section."""

    backend: Literal["wandb", "none"] = "wandb"
    project: str = "warsha"
    mode: Literal["offline", "online"] = "offline"
    entity: str | None = None


@dataclass
class Tracker:
    """No-op tracker: the interface every backend implements."""

    run_id: str | None = None

    def start(self, name: str, group: str, config: dict[str, Any], out_dir: Path) -> None:
        """Begin a run for one stage."""

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Record scalar metrics at a step."""

    def finish(self, summary: dict[str, Any]) -> None:
        """Record final metrics and close the run."""


@dataclass
class WandbTracker(Tracker):
    """wandb, one run per stage, grouped by recipe, in ``<run dir>/wandb``."""

    cfg: TrackingConfig = field(default_factory=TrackingConfig)
    _run: Any = None

    def start(self, name: str, group: str, config: dict[str, Any], out_dir: Path) -> None:
        """Initialise a wandb run; offline mode never touches the network."""
        import wandb

        out_dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_SILENT", "true")
        self._run = wandb.init(
            project=self.cfg.project,
            entity=self.cfg.entity,
            mode=self.cfg.mode,
            name=name,
            group=group,
            config=config,
            dir=str(out_dir),
            reinit="finish_previous",
        )
        self.run_id = self._run.id

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Log scalars to the active run."""
        if self._run is not None:
            self._run.log(metrics, step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        """Write the stage's flat metrics into the run summary and close it."""
        if self._run is None:
            return
        for key, value in flatten(summary).items():
            if isinstance(value, (int, float, str, bool)):
                self._run.summary[key] = value
        self._run.finish()
        self._run = None


def make_tracker(cfg: TrackingConfig, is_main: bool) -> Tracker:
    """The configured tracker on the main process, a no-op elsewhere."""
    if cfg.backend == "wandb" and is_main:
        return WandbTracker(cfg=cfg)
    return Tracker()


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a/b": 1}``: metric names for trackers and tables."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{key}/"))
        else:
            out[key] = v
    return out
