"""Part `kernels`: serve's Triton kernel tests, run by pytest in subprocesses.

One pytest run per test module for the default cases, each its own check, then (on CUDA) the
slow cases (`-m slow`: the full fp32/bf16 x 3-seed product) as the last check, so a part stopped
at its time limit keeps the modules it finished. On CUDA the kernels compile for the GPU; on CPU
they run under Triton's interpreter, default cases only (the slow product takes hours there).
`--quick` keeps the int4 GEMM tests alone. pytest's output streams into the part's log as it
runs; verdicts come from pytest's JUnit XML. On CUDA with pytest-xdist installed the tests run
in up to 8 worker processes: compiling the kernels is most of the time there (the first H200
run took 137 s for one module's 16 default cases in one process, a test of head size 256 up to
35 s) and it is CPU work that spreads over the machine's cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import deque
from pathlib import Path

from benchmarks.gpu_check.common import PartResult, part_main

ROOT = Path(__file__).resolve().parents[2]


def test_files(quick: bool) -> list[str]:
    """The Triton test modules (all of `tests/serve/test_triton_*`, or the int4 one)."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "serve").glob("test_triton_*.py"))
    return [f for f in files if f.endswith("test_triton_int4.py")] if quick else files


def junit_counts(xml: Path) -> tuple[dict[str, int], list[str]]:
    """(passed/failed/skipped counts, failed test ids) from a JUnit XML file, zeros if absent."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures: list[str] = []
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            key = {"failure": "failed", "error": "failed"}.get(kind, kind)
            counts[key] += 1
            if key == "failed":
                failures.append(f"{case.get('classname')}::{case.get('name')}")
    return counts, failures


def workers(cuda: bool) -> int:
    """pytest-xdist workers: up to 8 on CUDA where xdist is installed, else 0 (one process)."""
    if not cuda or importlib.util.find_spec("xdist") is None:
        return 0
    return min(8, os.cpu_count() or 1)


def run_pytest(result: PartResult, files: list[str], marks: str, xml: Path, n: int = 0) -> None:
    """One pytest run (`n` xdist workers, 0 for none), its output echoed line by line (the part's
    log shows progress), as one check."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "--durations=5", "-m", marks, f"--junitxml={xml}", *files]
    cmd += ["-n", str(n)] if n else []
    tail: deque[str] = deque(maxlen=30)
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            tail.append(line.rstrip())
    counts, failures = junit_counts(xml)
    ok = proc.returncode == 0 and counts["passed"] > 0
    last = [ln for ln in tail if ln.strip()][-1:]
    result.add(f"pytest {' '.join(Path(f).name for f in files)} -m '{marks}'", ok, **counts,
               failures=failures[:20], tail=list(tail)[-20:] if not ok else last)  # fmt: skip


def run(result: PartResult, args: argparse.Namespace) -> None:
    cuda = result.device == "cuda"
    if not cuda:
        result.skip("slow kernel cases", "the full fp32/bf16 x 3-seed product takes hours under the interpreter")
    files, n = test_files(args.quick), workers(cuda)
    for i, f in enumerate(files):
        run_pytest(result, [f], "not slow", args.workdir / f"junit-{i}.xml", n)
    if cuda:
        run_pytest(result, files, "slow", args.workdir / "junit-slow.xml", n)


if __name__ == "__main__":
    part_main("kernels", run)
