"""Batch-1 decode per ISA variant of serve's CPU kernels: `python -m benchmarks.isa_decode`.

What: greedy batch-1 decode of a real checkpoint (bf16, and a GPTQ int4 one when given) by
Warsha's engine once per kernel variant (`WARSHA_CPU_ISA`, e.g. avx2 against avx512_bf16) and
per LM-head format, each in its own subprocess (the ISA is chosen once at load), the variants
taking turns for `--rounds` rounds so that a shared host's load falls on all of them alike. Reports
decode tok/s on the wall clock and CPU milliseconds per token (this process's CPU time: on a host
shared with other work the wall clock also measures the scheduler), medians over rounds, each
contender's ratios to the first one, and whether the greedy ids equal the first contender's.

    python -m benchmarks.isa_decode --model runs/arabic-gemma3-270m/import \\
        --int4 runs/arabic-gemma3-270m/q4 --isas avx2,avx512_bf16 --rounds 3

JSON goes to benchmarks/results/isa_decode-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine, one variant (already chosen by the environment): decode and report.

    Decode cost per token = (a request of `new_tokens` - a request of 1 token) / (new_tokens - 1),
    on the wall clock and on this process's CPU time (the prompts differ, so no prefix is reused).
    """
    import torch

    from serve import LLM, SamplingParams, cpu_kernels

    torch.set_num_threads(spec["threads"])
    extra = {"int4_activations": "int8"} if spec["int4"] else {}
    llm = LLM(spec["model"], dtype=spec["dtype"], head_quant=spec["head_quant"], kv_cache_memory_gb=1.0, **extra)
    prompt, n = spec["prompt"], spec["new_tokens"]
    llm.generate([prompt[:8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    marks = [(time.perf_counter(), _cpu_seconds())]
    short = [3 + t for t in prompt]  # same length, other ids: no cached prefix for the long run
    llm.generate([short], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    marks.append((time.perf_counter(), _cpu_seconds()))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
    marks.append((time.perf_counter(), _cpu_seconds()))
    (w0, c0), (w1, c1), (w2, c2) = marks
    wall, cpu = ((w2 - w1) - (w1 - w0)) / (n - 1), ((c2 - c1) - (c1 - c0)) / (n - 1)
    isa = cpu_kernels.isa() if hasattr(cpu_kernels, "isa") else "avx2 (no dispatch)"
    return {"tok_per_s": 1.0 / wall, "cpu_ms_per_tok": cpu * 1e3, "ids": list(out.token_ids), "isa": isa}


def run_one(spec: dict[str, Any], contender: str) -> dict[str, Any]:
    """`worker` in a subprocess for one contender; its JSON or {"error": ...}.

    A contender is an ISA variant name (run with WARSHA_CPU_ISA set to it) or `src:DIR`: another
    checkout's `serve` (e.g. the main branch before a change), imported ahead of this one.
    """
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
    if contender.startswith("src:"):
        here = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join((contender[4:], here))
        env.pop("WARSHA_CPU_ISA", None)
    else:
        env["WARSHA_CPU_ISA"] = contender
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.isa_decode", "--worker", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The (checkpoint, head format) pairs to run: bf16 and int4, each with the given head formats."""
    out = []
    for label, model in (("bf16", args.model), ("gptq-int4", args.int4)):
        if model is None:
            continue
        for head in args.heads.split(","):
            case = {"case": f"{label} head={head}", "model": str(model), "head_quant": head, "int4": label != "bf16"}
            out.append(case)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, help="a bf16/float32 HF checkpoint (served in bf16)")
    p.add_argument("--int4", type=Path, help="a GPTQ int4 checkpoint of the same model")
    p.add_argument(
        "--isas",
        default="avx2,avx512_bf16",
        help="contenders, the first is the baseline: ISA variants, or src:DIR for another checkout's serve",
    )
    p.add_argument("--heads", default="none", help="LM head formats: none,int8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if args.model is None and args.int4 is None:
        p.error("give --model and/or --int4 (checkpoint directories)")
    for d in (args.model, args.int4):
        if d is not None and not (d / "config.json").is_file():
            p.error(f"{d}: no config.json; pass an HF checkpoint directory")
    isas = args.isas.split(",")
    prompt = [2 + (i * 7919) % 4000 for i in range(args.prompt_len)]  # fixed ids, the same for every run
    base = {"threads": args.threads, "dtype": "bfloat16", "prompt": prompt, "new_tokens": args.new_tokens}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for _ in range(args.rounds):
        for case in cases(args):
            for isa in isas:  # the variants take turns within each round
                r = run_one({**base, **case}, isa)
                runs.setdefault(case["case"], {}).setdefault(isa, []).append(r)
                shown = f"{r['tok_per_s']:.1f} tok/s, {r['cpu_ms_per_tok']:.1f} CPU ms/tok" if "tok_per_s" in r else r
                print(f"{case['case']:24s} {isa:12s} {shown}", flush=True)
    report = summarize(runs, isas)
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "load": os.getloadavg(), "rows": report}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"isa_decode-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({**out, "runs": runs}, indent=1))
    print(
        f"\n{'case':24s} {'contender':16s} {'tok/s':>7s} {'min-max':>13s} {'ratio':>6s}"
        f" {'CPU ms/tok':>10s} {'ratio':>6s} same ids"
    )
    for row in report:
        if "error" in row:
            print(f"{row['case']:24s} {row['isa']:12s} failed: {row['error'][-200:]}")
            continue
        print(
            f"{row['case']:24s} {row['isa'][-16:]:16s} {row['median']:7.1f} {row['min']:6.1f}-{row['max']:<6.1f}"
            f" {row['ratio']:6.2f} {row['cpu_ms_per_tok']:10.1f} {row['cpu_ratio']:6.2f} {row['same_ids']}"
        )
    print(f"\nwrote {path}")
    return 0


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]], isas: list[str]) -> list[dict[str, Any]]:
    """Median tok/s per case and variant, its ratio to the first variant, and greedy-id equality."""
    rows = []
    for case, by_isa in runs.items():
        ok = {isa: [r for r in by_isa.get(isa, []) if "tok_per_s" in r] for isa in isas}
        if not ok[isas[0]]:
            continue
        base = statistics.median(r["tok_per_s"] for r in ok[isas[0]])
        base_cpu = statistics.median(r["cpu_ms_per_tok"] for r in ok[isas[0]])
        for isa in isas:
            if not ok[isa]:
                rows.append({"case": case, "isa": isa, "error": by_isa[isa][-1].get("error", "")})
                continue
            rates = [r["tok_per_s"] for r in ok[isa]]
            rows.append(
                {
                    "case": case,
                    "isa": isa,
                    "ran": ok[isa][0]["isa"],
                    "median": statistics.median(rates),
                    "min": min(rates),
                    "max": max(rates),
                    "ratio": statistics.median(rates) / base,
                    "cpu_ms_per_tok": statistics.median(r["cpu_ms_per_tok"] for r in ok[isa]),
                    "cpu_ratio": base_cpu / statistics.median(r["cpu_ms_per_tok"] for r in ok[isa]),
                    "same_ids": ok[isa][0]["ids"] == ok[isas[0]][0]["ids"],
                }
            )
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
