"""Fixtures: tiny Llama configs and models built in-process, and a stage context without a runner."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest


def llama_config_dict(max_pos: int = 64, **extra: Any) -> dict[str, Any]:
    """config.json of a tiny Llama as transformers 5.23 writes it."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=max_pos,
        **extra,
    )
    return cfg.to_dict()


@pytest.fixture(scope="session")
def corpus() -> Any:
    """A small slice of the bundled corpus (the same one the tiny bootstrap fixture trains on)."""
    from warsha.data import DataConfig, load_corpus

    return load_corpus(DataConfig(collections=["bukhari"], max_documents=3000))


def make_ctx(tmp_path: Path, model_dir: Path, corpus: Any, seed: int = 0) -> Any:
    """A StageContext as the pipeline would build it, with a no-op tracker."""
    from warsha.stage import StageContext
    from warsha.tracking import Tracker

    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    return StageContext(
        stage="context_ext.yarn",
        stage_id="yarn",
        recipe=None,
        out_dir=out,  # type: ignore[arg-type]
        inputs={"model": model_dir},
        input_manifests={"model": None},
        checkpoint_dir=out / "checkpoints",
        tracker=Tracker(),
        device="cpu",
        seed=seed,
        log=logging.getLogger("test"),
        _corpus=corpus,
    )


def read_config(model_dir: Path) -> dict[str, Any]:
    """The config.json of a model directory."""
    return json.loads((model_dir / "config.json").read_text())
