"""Training throughput: Warsha's trainer step against a bare PyTorch loop, and the allocator's share.

For each stage's step (bootstrap, QLoRA adapt, YaRN fine-tune, distillation; the shapes are in
``warsha/train_cases.py``) two copies of the same model train on the same batches with the same AdamW
(``warsha.training.make_optimizer``):
one through ``warsha.training.Trainer`` (accelerate, gradient clipping, the loss sync, progress
and tracker reporting; checkpointing off), one through a bare ``loss / backward / step /
zero_grad`` loop calling the same loss function. The two alternate step by step in one process,
so a change of machine load hits both alike. Reported per loop: tokens per wall second, tokens
per CPU second (user + sys, from ``resource.getrusage`` deltas; less sensitive to a shared
machine), the sys share of CPU time, and the trainer's overhead in percent of the bare loop's
CPU time per step (``warsha.train_overhead``).

``--compare-allocators`` runs the same cases in child processes under each allocator policy of
``warsha.runtime``: ``WARSHA_ALLOCATOR=system`` (the C library's defaults, as every run had before
the policy existed), ``glibc-tuned`` and, where it is installed, ``tcmalloc``; the order rotates
round by round, and each policy's speed-up over ``system`` is reported per stage. Results go to
``benchmarks/results/train_bench-<tag>.json``.

    python -m benchmarks.train_bench --steps 6
    python -m benchmarks.train_bench --steps 6 --compare-allocators --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from warsha import train_cases
from warsha.train_overhead import BASELINE, allocator_row, child_env, run_case

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]


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
    out["stages"] = {name: allocator_row(runs, name) for name in args.cases}
    return out


def _child(args: argparse.Namespace, allocator: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "benchmarks.train_bench", "--steps", str(args.steps), "--cases", *args.cases]
        cmd += ["--child-out", str(path)]
        subprocess.run(cmd, env=child_env(allocator), check=True, cwd=ROOT)
        return json.loads(path.read_text())


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
