"""Part `kernels`: serve's Triton kernel tests, run by pytest in a subprocess.

On CUDA the kernels compile for the GPU and both default and slow cases run (`-m "slow or not
slow"`); on CPU they run under Triton's interpreter, default cases only (the slow product takes
hours there). `--quick` keeps the int4 GEMM tests alone. Verdicts come from pytest's JUnit XML.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks.gpu_check.common import PartResult, part_main

ROOT = Path(__file__).resolve().parents[2]


def test_files(quick: bool) -> list[str]:
    """The Triton test modules (all of `tests/serve/test_triton_*`, or the int4 one)."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "serve").glob("test_triton_*.py"))
    return [f for f in files if f.endswith("test_triton_int4.py")] if quick else files


def run(result: PartResult, args: argparse.Namespace) -> None:
    xml = args.workdir / "junit.xml"
    marks = "slow or not slow" if result.device == "cuda" else "not slow"
    if result.device != "cuda":
        result.skip("slow kernel cases", "the full fp32/bf16 x 3-seed product takes hours under the interpreter")
    files = test_files(args.quick)
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", marks, f"--junitxml={xml}", *files]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            key = {"failure": "failed", "error": "failed"}.get(kind, kind)
            counts[key] += 1
            if key == "failed":
                failures.append(f"{case.get('classname')}::{case.get('name')}")
    ok = proc.returncode == 0 and counts["passed"] > 0
    result.add(f"pytest {' '.join(Path(f).name for f in files)} -m '{marks}'", ok, **counts, failures=failures[:20],
               tail=proc.stdout[-1500:] if not ok else proc.stdout.strip().splitlines()[-1:])  # fmt: skip


if __name__ == "__main__":
    part_main("kernels", run)
