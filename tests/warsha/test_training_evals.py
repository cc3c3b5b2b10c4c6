"""The Trainer's held-out evaluation hook: when it runs, what it records, and that resume keeps it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from warsha.config import Recipe
from warsha.stage import StageContext
from warsha.tracking import Tracker
from warsha.training import Trainer, TrainParams


class TinyLM(torch.nn.Module):
    """A bigram model: enough for `causal_lm_loss`, small enough to train in milliseconds."""

    def __init__(self, vocab: int = 16) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **_: Any) -> Any:
        logits = self.emb(input_ids)
        loss = (
            torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
            if labels is not None
            else None
        )
        return type("Out", (), {"logits": logits, "loss": loss})()


def _ctx(root: Path) -> StageContext:
    return StageContext(
        stage="t",
        stage_id="t",
        recipe=Recipe(name="t"),
        out_dir=root,
        inputs={},
        input_manifests={},
        checkpoint_dir=root / "ckpt",
        tracker=Tracker(),
        device="cpu",
        seed=0,
        log=logging.getLogger("test"),
    )


def _batch(step: int, micro: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, 16, (2, 8), generator=g)}


def _run(root: Path, steps: int, crash_at: int | None = None, final_eval: bool = True) -> Any:
    held_out = torch.arange(16).repeat(2, 1)
    seen: list[bool] = []

    def eval_fn(model: Any) -> dict[str, float]:
        seen.append(model.training)
        if crash_at is not None and len(seen) > crash_at:
            raise KeyboardInterrupt
        return {"loss": float(model(held_out, labels=held_out).loss)}

    torch.manual_seed(0)
    p = TrainParams(
        steps=steps, batch_size=2, seq_len=8, lr=0.05, warmup_steps=0, checkpoint_every=2, eval_every=2, bf16=False
    )
    trainer = Trainer(model=TinyLM(), p=p, ctx=_ctx(root), batch_fn=_batch, eval_fn=eval_fn, final_eval=final_eval)
    result = trainer.run()
    assert not any(seen), "evaluation must run in eval mode"
    return result


def test_evaluates_at_start_every_n_steps_and_at_the_end(tmp_path: Path) -> None:
    result = _run(tmp_path, steps=5)
    assert [e["step"] for e in result.evals] == [0, 2, 4, 5]
    assert all(set(e) == {"step", "loss"} for e in result.evals)
    assert result.evals[-1]["loss"] != result.evals[0]["loss"]


def test_final_eval_off_leaves_the_last_step_to_the_caller(tmp_path: Path) -> None:
    """A caller that scores the finished model itself (adapt) gets no last point from the loop,
    also where the last step is a multiple of ``eval_every``."""
    assert [e["step"] for e in _run(tmp_path / "a", steps=5, final_eval=False).evals] == [0, 2, 4]
    assert [e["step"] for e in _run(tmp_path / "b", steps=6, final_eval=False).evals] == [0, 2, 4]


def test_a_resumed_run_keeps_earlier_evaluations(tmp_path: Path) -> None:
    straight = _run(tmp_path / "a", steps=6)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path / "b", steps=6, crash_at=3)  # dies at the step-6 evaluation, after step-4 checkpoint
    resumed = _run(tmp_path / "b", steps=6)
    assert resumed.resumed_from == 4
    assert [e["step"] for e in resumed.evals] == [0, 2, 4, 6]
    for a, b in zip(straight.evals, resumed.evals):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
