"""Run the GPU check's parts one after another and write `report.json` and `report.md`.

`python -m benchmarks.gpu_check [--out DIR] [--parts kernels,engine,...] [--quick]`. Each part
runs as `python -m benchmarks.gpu_check.<part>` in a subprocess under its own time limit; the
limits add up to 9 minutes on one GPU. Without CUDA every part runs what it can on the
CPU (Triton under its interpreter) and names each thing it skipped and why. Exit status 1 when
any check failed, 0 otherwise (skips are not failures).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_check.common import FAIL, environment
from benchmarks.gpu_check.report import write_markdown

# seconds per part on a GPU (9 minutes in all: one device call runs at most 10) and on
# a CPU (generous: a shared CI host can be many times slower than the few minutes the CPU mode takes)
PARTS: dict[str, tuple[int, int]] = {
    "kernels": (150, 1200),
    "engine": (210, 1200),
    "speed": (120, 0),
    "train": (30, 1200),
    "validate": (30, 1200),
}
CUDA_ONLY = {"speed": "TinyLlama-shape throughput and the HBM roofline"}
ROOT = Path(__file__).resolve().parents[2]


def _env(cuda: bool) -> dict[str, str]:
    """The parts' environment: offline, and Triton interpreted where there is no GPU."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("WANDB_MODE", "offline")
    if cuda:
        env.pop("TRITON_INTERPRET", None)
    else:
        env["TRITON_INTERPRET"] = "1"  # before any part imports triton
    return env


def run_part(name: str, out: Path, quick: bool, cuda: bool) -> dict[str, Any]:
    """One part in a subprocess; a crash or a timeout becomes a failed part with the log's tail."""
    limit = PARTS[name][0 if cuda else 1]
    if not cuda and name in CUDA_ONLY:  # not even started: nothing of it can run here
        skipped = [{"what": CUDA_ONLY[name], "why": "no CUDA device"}]
        return {"part": name, "status": "skip", "checks": [], "skipped": skipped, "seconds": 0.0}
    result_file, log_file = out / f"{name}.json", out / f"{name}.log"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", f"benchmarks.gpu_check.{name}", "--json", str(result_file)]
    cmd += ["--workdir", str(out / "work" / name)] + (["--quick"] if quick else [])
    start = time.perf_counter()
    print(f"[gpu-check] {name} (limit {limit} s) ...", flush=True)
    with log_file.open("w") as log:
        # its own process group: on a timeout the part and what it started (pytest) stop together
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=_env(cuda), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc: int | str = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = f"timed out after {limit} s"
    if result_file.is_file():
        result = json.loads(result_file.read_text())
        if isinstance(rc, str):
            result["seconds"] = round(time.perf_counter() - start, 1)
        if isinstance(rc, str) and result.get("finished"):  # its work was done: only the exit was slow
            result["note"] = f"{rc}: every check had finished; the process was still exiting (CUDA teardown)"
        elif isinstance(rc, str):  # stopped at its limit: what it finished stands, the part fails
            result.update(status=FAIL, error=f"{rc}; the checks listed finished before it")
        return result
    tail = log_file.read_text()[-3000:]
    return {"part": name, "status": FAIL, "error": f"exit {rc}; log tail:\n{tail}", "checks": [], "skipped": [],
            "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-check"), help="report folder")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    parser.add_argument("--quick", action="store_true", help="the small CPU subset the test suite runs")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown part {unknown[0]!r}; choose from {', '.join(PARTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    env["triton_interpret"] = _env(bool(env["cuda"])).get("TRITON_INTERPRET", "0")
    started = time.perf_counter()
    results = [run_part(p, args.out.resolve(), args.quick, bool(env["cuda"])) for p in parts]
    report = {
        "environment": env,
        "quick": args.quick,
        "seconds": round(time.perf_counter() - started, 1),
        "status": FAIL if any(r["status"] == FAIL for r in results) else "pass",
        "parts": results,
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    write_markdown(report, args.out / "report.md")
    print(f"[gpu-check] {report['status']} in {report['seconds']} s: {args.out / 'report.md'}", flush=True)
    return 1 if report["status"] == FAIL else 0


if __name__ == "__main__":
    sys.exit(main())
