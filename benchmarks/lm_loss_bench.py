"""The fused LM head + cross-entropy (``warsha.lm_loss``) against the unfused path it replaced.

For the bootstrap and YaRN fine-tune steps of ``warsha.train_cases`` (the stages whose head is a plain
weight; QLoRA's peft-wrapped head keeps the model's forward), two identical models train on the
same batches, one with each loss, their steps alternating in one process so that a change of
machine load hits both. The unfused path is what transformers does: logits for every scored row,
``F.cross_entropy``, autograd through both. Reported: median seconds per step, tokens/s, the
speed-up, the largest loss difference over the run, and each loss's peak resident memory for two
steps measured in a child process of its own (``VmHWM`` above the model's baseline).
Results go to ``benchmarks/results/lm_loss_bench-<tag>.json``.

    python -m benchmarks.lm_loss_bench --steps 9
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from warsha import runtime
from warsha.cli import quiet_environment

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CASES = ("bootstrap", "yarn")
LOSSES = ("unfused", "fused")


def loss_fn(name: str) -> Any:
    """The loss called ``name``: the fused one of ``warsha.lm_loss``, or transformers' path."""
    import torch.nn.functional as F

    from warsha import lm_loss

    def unfused(model: Any, batch: dict[str, Any]) -> Any:
        ids = batch["input_ids"]
        if "loss_weights" not in batch:
            return model(input_ids=ids, labels=ids).loss
        weights = batch["loss_weights"][:, 1:]
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[:, :-1]
        keep = weights > 0
        logits = model.get_output_embeddings()(hidden[keep]).float()
        nll = F.cross_entropy(logits, ids[:, 1:][keep], reduction="none")
        return (nll * weights[keep]).sum() / weights[keep].sum()

    return unfused if name == "unfused" else lm_loss.causal_lm_loss


def time_case(case_name: str, steps: int) -> dict[str, Any]:
    """Both losses on one case, steps alternating (the order flips every step)."""
    import torch

    from warsha import train_cases

    case = train_cases.CASES[case_name](argparse.Namespace(steps=steps))
    models = {n: case.make_model() for n in LOSSES}
    opts = {
        n: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=case.lr, fused=True)
        for n, m in models.items()
    }
    seconds: dict[str, list[float]] = {n: [] for n in LOSSES}
    losses: dict[str, list[float]] = {n: [] for n in LOSSES}
    for step in range(steps):
        batch = case.batch_fn(step, 0, 0)
        for n in LOSSES if step % 2 else LOSSES[::-1]:
            start = time.perf_counter()
            loss = loss_fn(n)(models[n], batch)
            loss.backward()
            opts[n].step()
            opts[n].zero_grad()
            seconds[n].append(time.perf_counter() - start)
            losses[n].append(loss.item())
    tokens = case.batch_size * case.seq_len
    out: dict[str, Any] = {"tokens_per_step": tokens, "max_loss_diff": max(map(abs, _diff(losses)))}
    for n in LOSSES:
        median = sorted(seconds[n][1:])[(steps - 1) // 2]  # the first step warms up
        out[n] = {"s_per_step": median, "tok_per_s": tokens / median, "losses": losses[n]}
    out["speedup"] = out["unfused"]["s_per_step"] / out["fused"]["s_per_step"]
    return out


def _diff(losses: dict[str, list[float]]) -> list[float]:
    return [a - b for a, b in zip(losses["unfused"], losses["fused"])]


def peak_memory(case_name: str, loss: str) -> float:
    """MB of resident memory two steps of ``loss`` add to the model's baseline (child process).

    Read from ``VmHWM`` rather than ``ru_maxrss``: the latter survives exec, so a child forked
    from this (larger) process would start from the parent's peak.
    """
    code = (
        "import sys, argparse; from warsha import train_cases; from benchmarks import lm_loss_bench as b;"
        "c = train_cases.CASES[sys.argv[1]](argparse.Namespace(steps=2)); m = c.make_model();"
        "f = b.loss_fn(sys.argv[2]);"
        "base = b.high_water_mb(); [f(m, c.batch_fn(s, 0, 0)).backward() for s in (0, 1)];"
        "print(b.high_water_mb() - base)"
    )
    cmd = [sys.executable, "-c", code, case_name, loss]
    return float(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout.split()[-1])


def high_water_mb() -> float:
    """This process's peak resident memory so far (Linux ``VmHWM``), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmHWM line (the memory figure needs Linux)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=9, help="steps per loss and case (the first is warm-up)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    if bad := set(cases) - set(CASES):
        p.error(f"--cases: unknown {sorted(bad)}; use {', '.join(CASES)}")
    if args.steps < 3:
        p.error(f"--steps must be at least 3 (one warm-up, then a median), got {args.steps}")
    quiet_environment()
    runtime.apply(reexec=True)
    import torch

    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {"threads": args.threads, "load": os.getloadavg(), "cases": {}}
    print(f"{'case':10s} {'unfused s/step':>15s} {'fused s/step':>13s} {'speed-up':>9s} {'peak MB unfused/fused':>22s}")
    for name in cases:
        r = time_case(name, args.steps)
        r["peak_mb"] = {n: peak_memory(name, n) for n in LOSSES}
        results["cases"][name] = r
        mem = f"{r['peak_mb']['unfused']:.0f} / {r['peak_mb']['fused']:.0f}"
        print(
            f"{name:10s} {r['unfused']['s_per_step']:15.3f} {r['fused']['s_per_step']:13.3f} "
            f"{r['speedup']:8.2f}x {mem:>22s}   max |loss diff| {r['max_loss_diff']:.1e}"
        )
    results["load_end"] = os.getloadavg()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"lm_loss_bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"load {results['load']} -> {results['load_end']}\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
