"""The trainer's overhead over a bare loop, and the allocator policies' effect on training steps.

`python -m benchmarks.train_bench` runs these; they live in the core so that what the benchmark
reports is tested (tests/warsha/test_train_overhead.py):

- `run_case`: two copies of a model (`warsha.train_cases`) trained on the same batches, one through
  `Trainer.train_step` (accelerate, clipping, the loss sync, reporting), one through a bare
  ``loss / backward / step / zero_grad`` loop, steps alternating so a change of machine load hits
  both; per loop tokens per wall and CPU second and the sys share;
- `child_env`: the environment for a child measured under one allocator policy;
- `allocator_row`: one stage's policies over rounds, and their speed-ups over ``system``.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path
from typing import Any

from warsha.train_cases import Case

BASELINE = "system"


class Clock:
    """Wall, user and sys seconds spent inside ``with`` blocks, summed."""

    def __init__(self) -> None:
        self.wall = self.user = self.sys = 0.0

    def __enter__(self) -> Clock:
        self._w, self._r = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        return self

    def __exit__(self, *exc: object) -> None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        self.wall += time.perf_counter() - self._w
        self.user += r.ru_utime - self._r.ru_utime
        self.sys += r.ru_stime - self._r.ru_stime


class _NoBar:
    def set_postfix(self, **_: Any) -> None:
        """The trainer's progress bar, silent here (its cost is a string format)."""


def _row(clock: Clock, tokens: int, steps: int) -> dict[str, float]:
    cpu = clock.user + clock.sys
    return {
        "wall_s": clock.wall,
        "user_s": clock.user,
        "sys_s": clock.sys,
        "tokens_per_s": tokens / clock.wall,
        "tokens_per_cpu_s": tokens / cpu,
        "sys_share": clock.sys / cpu,
        "cpu_s_per_step": cpu / steps,
    }


def run_case(case: Case, args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Trainer and bare loop on ``case``, alternating step by step; one row per loop."""
    import torch

    from warsha.stage import StageContext
    from warsha.tracking import TrackingConfig, make_tracker
    from warsha.training import AccelerateBackend, Trainer, TrainParams, make_accelerator, make_optimizer

    p = TrainParams(steps=10**6, batch_size=case.batch_size, seq_len=case.seq_len, lr=case.lr, warmup_steps=0,
                    checkpoint_every=10**6, log_every=10, bf16=False)  # fmt: skip
    ctx = StageContext(
        stage=name, stage_id="bench", recipe=None, out_dir=Path("/nonexistent"), inputs={}, input_manifests={},
        checkpoint_dir=Path("/nonexistent"), tracker=make_tracker(TrackingConfig(backend="none"), True),
        device="cpu", seed=0,
    )  # fmt: skip
    ours_model, bare_model = case.make_model(), case.make_model()
    trainer = Trainer(ours_model, p, ctx, case.batch_fn, loss_fn=case.loss_fn, name=name)
    backend = AccelerateBackend(make_accelerator("cpu", p), p)
    model, opt = backend.prepare(ours_model, _trainable(ours_model))
    bare_opt = make_optimizer(_trainable(bare_model), p)  # the same optimizer the trainer builds

    losses: dict[str, list[float]] = {"trainer": [], "bare": []}

    def bare_step(step: int) -> None:
        loss = case.loss_fn(bare_model, case.batch_fn(step, 0, 0))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(bare_model.parameters(), p.max_grad_norm)
        bare_opt.step()
        bare_opt.zero_grad(set_to_none=True)
        losses["bare"].append(float(loss.detach()))

    def ours_step(step: int) -> None:
        loss, _ = trainer.train_step(backend, model, opt, step)
        trainer.report(_NoBar(), step, loss, 0.0)
        losses["trainer"].append(loss)

    ours_step(0)  # warm-up: first-touch of weights, optimizer state and kernels
    bare_step(0)
    clocks = {"trainer": Clock(), "bare": Clock()}
    for step in range(1, args.steps + 1):
        order = (("trainer", ours_step), ("bare", bare_step))
        for loop, fn in order if step % 2 else order[::-1]:  # alternate who goes first
            with clocks[loop]:
                fn(step)
    tokens = args.steps * case.batch_size * case.seq_len
    rows: dict[str, Any] = {loop: _row(c, tokens, args.steps) for loop, c in clocks.items()}
    rows["overhead_pct"] = 100 * (rows["trainer"]["cpu_s_per_step"] / rows["bare"]["cpu_s_per_step"] - 1)
    rows["tokens_per_step"] = case.batch_size * case.seq_len
    rows["losses"] = losses  # the same work: equal curves (tests/warsha/test_train_overhead.py)
    return rows


def _trainable(model: Any) -> list[Any]:
    return [q for q in model.parameters() if q.requires_grad]


def child_env(allocator: str) -> dict[str, str]:
    """This environment minus any allocator policy it carries, asking the child for ``allocator``.

    A parent started under tcmalloc or glibc-tuned exports its policy (``LD_PRELOAD``,
    ``MALLOC_*_``); a child that inherited it would measure the parent's policy, not its own.
    """
    from warsha.runtime import REEXEC_MARK

    env = {**os.environ, "WARSHA_ALLOCATOR": allocator}
    for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", REEXEC_MARK):
        env.pop(key, None)
    kept = [lib for lib in env.pop("LD_PRELOAD", "").split() if "tcmalloc" not in lib]
    if kept:
        env["LD_PRELOAD"] = " ".join(kept)
    return env


def allocator_row(runs: dict[str, list[dict[str, Any]]], name: str) -> dict[str, Any]:
    """Per policy: the trainer loop's tokens/s and sys share over all rounds; speed-ups over system."""
    row: dict[str, Any] = {}
    for alloc, results in runs.items():
        wall = sum(r[name]["trainer"]["wall_s"] for r in results)
        user = sum(r[name]["trainer"]["user_s"] for r in results)
        sys_s = sum(r[name]["trainer"]["sys_s"] for r in results)
        tokens = sum(r[name]["trainer"]["tokens_per_s"] * r[name]["trainer"]["wall_s"] for r in results)
        row[alloc] = {"tokens_per_s": tokens / wall, "sys_share": sys_s / (user + sys_s), "sys_per_user": sys_s / user}
    for alloc in runs:
        row[alloc]["speedup"] = row[alloc]["tokens_per_s"] / row[BASELINE]["tokens_per_s"]
    return row
