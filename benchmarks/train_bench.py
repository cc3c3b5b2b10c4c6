"""Training throughput: Warsha's trainer step against a bare PyTorch loop, and the allocator's share.

For each stage's step (bootstrap, QLoRA adapt, YaRN fine-tune, distillation; the shapes are in
``train_cases.py``) two copies of the same model train on the same batches with the same AdamW
(``warsha.training.make_optimizer``):
one through ``warsha.training.Trainer`` (accelerate, gradient clipping, the loss sync, progress
and tracker reporting; checkpointing off), one through a bare ``loss / backward / step /
zero_grad`` loop calling the same loss function. The two alternate step by step in one process,
so a change of machine load hits both alike. Reported per loop: tokens per wall second, tokens
per CPU second (user + sys, from ``resource.getrusage`` deltas; less sensitive to a shared
machine), the sys share of CPU time, and the trainer's overhead in percent of the bare loop's
CPU time per step.

``--compare-allocators`` runs the same cases in child processes under each allocator policy of
``warsha.runtime``: ``WARSHA_ALLOCATOR=system`` (the C library's defaults, as every run had before
the policy existed), ``glibc-tuned`` and, where it is installed, ``tcmalloc``; the order rotates
round by round, and each policy's speed-up over ``system`` is reported per stage. Results go to
``benchmarks/results/train_bench-<tag>.json``.

    python benchmarks/train_bench.py --steps 6
    python benchmarks/train_bench.py --steps 6 --compare-allocators --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import train_cases  # noqa: E402
from train_cases import Case  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BASELINE = "system"


class _Clock:
    """Wall, user and sys seconds spent inside ``with`` blocks, summed."""

    def __init__(self) -> None:
        self.wall = self.user = self.sys = 0.0

    def __enter__(self) -> _Clock:
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


def _row(clock: _Clock, tokens: int, steps: int) -> dict[str, float]:
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
    from warsha.training import Trainer, TrainParams, make_accelerator, make_optimizer

    p = TrainParams(steps=10**6, batch_size=case.batch_size, seq_len=case.seq_len, lr=case.lr, warmup_steps=0,
                    checkpoint_every=10**6, log_every=10, bf16=False)  # fmt: skip
    ctx = StageContext(
        stage=name, stage_id="bench", recipe=None, out_dir=Path("/nonexistent"), inputs={}, input_manifests={},
        checkpoint_dir=Path("/nonexistent"), tracker=make_tracker(TrackingConfig(backend="none"), True),
        device="cpu", seed=0,
    )  # fmt: skip
    ours_model, bare_model = case.make_model(), case.make_model()
    trainer = Trainer(ours_model, p, ctx, case.batch_fn, loss_fn=case.loss_fn, name=name)
    acc = make_accelerator("cpu", p)
    model, opt = acc.prepare(ours_model, make_optimizer(_trainable(ours_model), p))
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
        loss, _ = trainer._step(acc, model, opt, step)
        trainer._report(_NoBar(), step, loss, 0.0)
        losses["trainer"].append(loss)

    ours_step(0)  # warm-up: first-touch of weights, optimizer state and kernels
    bare_step(0)
    clocks = {"trainer": _Clock(), "bare": _Clock()}
    for step in range(1, args.steps + 1):
        order = (("trainer", ours_step), ("bare", bare_step))
        for loop, fn in order if step % 2 else order[::-1]:  # alternate who goes first
            with clocks[loop]:
                fn(step)
    tokens = args.steps * case.batch_size * case.seq_len
    rows: dict[str, Any] = {loop: _row(c, tokens, args.steps) for loop, c in clocks.items()}
    rows["overhead_pct"] = 100 * (rows["trainer"]["cpu_s_per_step"] / rows["bare"]["cpu_s_per_step"] - 1)
    rows["tokens_per_step"] = case.batch_size * case.seq_len
    rows["losses"] = losses  # the same work: equal curves (tests/warsha/test_train_bench.py)
    return rows


def _trainable(model: Any) -> list[Any]:
    return [q for q in model.parameters() if q.requires_grad]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every requested case in this process, under this process's allocator policy."""
    from warsha import runtime

    info = runtime.apply(reexec=True)  # allocator and threads before the first tensor
    preload = os.environ.get("LD_PRELOAD", "")
    out: dict[str, Any] = {"runtime": info, "ld_preload": preload, "load_avg_start": os.getloadavg()}
    out["args"] = vars(args)
    for name in args.cases:
        out[name] = run_case(train_cases.CASES[name](args), args, name)
        _log(f"{name}: trainer {out[name]['trainer']['tokens_per_s']:.0f} tok/s, bare "
             f"{out[name]['bare']['tokens_per_s']:.0f}, overhead {out[name]['overhead_pct']:+.1f}%")  # fmt: skip
    out["load_avg_end"] = os.getloadavg()
    return out


def compare_allocators(args: argparse.Namespace) -> dict[str, Any]:
    """Children under each policy, the order rotated per round; each policy's ratio to ``system``."""
    from serve.runtime import find_tcmalloc

    policies = [BASELINE, "glibc-tuned"] + (["tcmalloc"] if find_tcmalloc() else [])
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in policies}
    load_start = os.getloadavg()
    for rnd in range(args.rounds):
        for alloc in policies[rnd % len(policies) :] + policies[: rnd % len(policies)]:
            _log(f"round {rnd + 1}/{args.rounds}: WARSHA_ALLOCATOR={alloc}")
            runs[alloc].append(_child(args, alloc))
    out: dict[str, Any] = {"args": vars(args), "load_avg_start": load_start, "load_avg_end": os.getloadavg()}
    out["runs"] = runs
    out["stages"] = {name: _allocator_row(runs, name) for name in args.cases}
    return out


def _child(args: argparse.Namespace, allocator: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.json"
        cmd = [sys.executable, __file__, "--steps", str(args.steps), "--cases", *args.cases, "--child-out", str(path)]
        env = _clean_env(allocator)
        subprocess.run(cmd, env=env, check=True)
        return json.loads(path.read_text())


def _clean_env(allocator: str) -> dict[str, str]:
    """This environment minus any allocator policy it carries, asking the child for ``allocator``.

    A parent started under tcmalloc or glibc-tuned exports its policy (``LD_PRELOAD``,
    ``MALLOC_*_``); a child that inherited it would measure the parent's policy, not its own.
    """
    from serve.runtime import REEXEC_MARK

    env = {**os.environ, "WARSHA_ALLOCATOR": allocator}
    for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", REEXEC_MARK):
        env.pop(key, None)
    kept = [lib for lib in env.pop("LD_PRELOAD", "").split() if "tcmalloc" not in lib]
    if kept:
        env["LD_PRELOAD"] = " ".join(kept)
    return env


def _allocator_row(runs: dict[str, list[dict[str, Any]]], name: str) -> dict[str, Any]:
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


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _print_measure(out: dict[str, Any]) -> None:
    print(f"runtime {out['runtime']} LD_PRELOAD={out['ld_preload'] or '-'} "
          f"load {out['load_avg_start']} -> {out['load_avg_end']}")  # fmt: skip
    print(f"{'stage':<10} {'loop':<8} {'tok/s':>8} {'tok/cpu-s':>10} {'sys %':>6} {'cpu s/step':>10}")
    for case in out["args"]["cases"]:
        for loop in ("trainer", "bare"):
            r = out[case][loop]
            print(f"{case:<10} {loop:<8} {r['tokens_per_s']:>8.0f} {r['tokens_per_cpu_s']:>10.0f} "
                  f"{100 * r['sys_share']:>6.1f} {r['cpu_s_per_step']:>10.2f}")  # fmt: skip
        print(f"{case:<10} trainer overhead {out[case]['overhead_pct']:+.1f}% (CPU time per step)")


def _print_allocators(out: dict[str, Any]) -> None:
    print(f"load {out['load_avg_start']} -> {out['load_avg_end']}; {out['args']['rounds']} rounds per policy")
    print(f"{'stage':<10} {'allocator':<12} {'tok/s':>8} {'sys %':>6} {'vs system':>9}")
    for name, row in out["stages"].items():
        for alloc, r in row.items():
            print(f"{name:<10} {alloc:<12} {r['tokens_per_s']:>8.0f} {100 * r['sys_share']:>6.1f} "
                  f"{r['speedup']:>8.2f}x")  # fmt: skip


def main() -> None:
    from warsha.cli import quiet_environment

    quiet_environment()  # offline, and none of the libraries' every-run warnings (as the `warsha` CLI)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="measured steps per loop (after one warm-up step)")
    ap.add_argument("--cases", nargs="*", default=list(train_cases.CASES), choices=list(train_cases.CASES))
    ap.add_argument("--compare-allocators", action="store_true", help="each stage per allocator policy")
    ap.add_argument("--rounds", type=int, default=2, help="with --compare-allocators: runs per policy")
    ap.add_argument("--tag", default=None, help="results file suffix (default: the allocator in effect)")
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_out:
        Path(args.child_out).write_text(json.dumps(measure(args)))
        return
    if args.compare_allocators:
        out = compare_allocators(args)
        _print_allocators(out)
        tag = args.tag or "allocators"
    else:
        out = measure(args)
        _print_measure(out)
        tag = args.tag or out["runtime"]["allocator"]
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"train_bench-{tag}.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
