"""Training throughput: Warsha's trainer step against a bare PyTorch loop, and the kernel's share.

For each stage's step (so far: the bootstrap step) two copies of the same model train on the same
batches with the same AdamW: one through ``warsha.training.Trainer`` (accelerate, gradient
clipping, the loss sync, progress and tracker reporting; checkpointing off), one through a bare
``forward / backward / step / zero_grad`` loop. The two alternate step by step in one process,
so a change of machine load hits both alike. Reported per loop: tokens per wall second, tokens
per CPU second (user + sys, from ``resource.getrusage`` deltas; less sensitive to a shared
machine), the sys share of CPU time, and the trainer's overhead in percent of the bare loop's
CPU time per step.

The allocator policy is the process's (``warsha.runtime``): compare policies by running this
script once per policy, e.g. ``WARSHA_ALLOCATOR=system`` against the default, or with
``LD_PRELOAD`` of jemalloc. Results go to ``benchmarks/results/train_bench-<tag>.json``.

    python benchmarks/train_bench.py --steps 6 --tag glibc-tuned
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


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


def bootstrap_case(args: argparse.Namespace) -> dict[str, Any]:
    """The bootstrap step: the demo recipe's model and batch shape, random tokens."""
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from warsha.stage import StageContext
    from warsha.tracking import TrackingConfig, make_tracker
    from warsha.training import Trainer, TrainParams, make_accelerator

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    bare_model = LlamaForCausalLM(cfg).to(torch.float32)
    ours_model = copy.deepcopy(bare_model)
    p = TrainParams(steps=10**6, batch_size=args.batch_size, seq_len=args.seq_len, lr=1e-3, warmup_steps=0,
                    checkpoint_every=10**6, log_every=10, bf16=False)  # fmt: skip
    batches = [torch.randint(0, args.vocab, (args.batch_size, args.seq_len)) for _ in range(args.steps + 1)]

    def batch_fn(step: int, micro: int, rank: int) -> dict[str, torch.Tensor]:
        return {"input_ids": batches[step], "labels": batches[step]}

    ctx = StageContext(
        stage="bootstrap", stage_id="bench", recipe=None, out_dir=Path("/nonexistent"), inputs={},
        input_manifests={}, checkpoint_dir=Path("/nonexistent"), tracker=make_tracker(TrackingConfig(backend="none"),
        True), device="cpu", seed=0,
    )  # fmt: skip
    trainer = Trainer(ours_model, p, ctx, batch_fn, name="bootstrap")
    acc = make_accelerator("cpu", p)
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=p.lr)
    model, opt = acc.prepare(ours_model, ours_opt)
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=p.lr)

    def bare_step(step: int) -> None:
        ids = batches[step]
        loss = bare_model(input_ids=ids, labels=ids).loss
        loss.backward()
        bare_opt.step()
        bare_opt.zero_grad(set_to_none=True)

    def ours_step(step: int) -> None:
        loss, _ = trainer._step(acc, model, opt, step)
        trainer._report(_NoBar(), step, loss, 0.0)

    ours_step(0)  # warm-up: first-touch of weights, optimizer state and kernels
    bare_step(0)
    clocks = {"trainer": _Clock(), "bare": _Clock()}
    for step in range(1, args.steps + 1):
        order = (("trainer", ours_step), ("bare", bare_step))
        for name, fn in order if step % 2 else order[::-1]:  # alternate who goes first
            with clocks[name]:
                fn(step)
    tokens = args.steps * args.batch_size * args.seq_len
    rows = {name: _row(c, tokens, args.steps) for name, c in clocks.items()}
    rows["overhead_pct"] = 100 * (rows["trainer"]["cpu_s_per_step"] / rows["bare"]["cpu_s_per_step"] - 1)
    return rows


CASES = {"bootstrap": bootstrap_case}


def main() -> None:
    from warsha import runtime

    info = runtime.apply()  # allocator and threads before the first tensor
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="measured steps per loop (after one warm-up step)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32768, help="vocabulary size of the bootstrap model")
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--tag", default=None, help="results file suffix (default: the allocator in effect)")
    args = ap.parse_args()
    preload = os.environ.get("LD_PRELOAD", "")
    out: dict[str, Any] = {"runtime": info, "ld_preload": preload, "load_avg_start": os.getloadavg()}
    out["args"] = vars(args)
    for case in args.cases:
        out[case] = CASES[case](args)
    out["load_avg_end"] = os.getloadavg()
    print(f"runtime {info} LD_PRELOAD={preload or '-'} load {out['load_avg_start']} -> {out['load_avg_end']}")
    print(f"{'stage':<10} {'loop':<8} {'tok/s':>8} {'tok/cpu-s':>10} {'sys %':>6} {'cpu s/step':>10}")
    for case in args.cases:
        for loop in ("trainer", "bare"):
            r = out[case][loop]
            print(f"{case:<10} {loop:<8} {r['tokens_per_s']:>8.0f} {r['tokens_per_cpu_s']:>10.0f} "
                  f"{100 * r['sys_share']:>6.1f} {r['cpu_s_per_step']:>10.2f}")  # fmt: skip
        print(f"{case:<10} trainer overhead {out[case]['overhead_pct']:+.1f}% (CPU time per step)")
    RESULTS.mkdir(exist_ok=True)
    tag = args.tag or (Path(preload).name.split(".")[0] if preload else info["allocator"])
    path = RESULTS / f"train_bench-{tag}.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
