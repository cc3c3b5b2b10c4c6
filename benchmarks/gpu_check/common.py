"""What every part shares: its command line, the device it runs on, and its result record."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclass
class Check:
    """One comparison: what, its verdict and the numbers behind it."""

    name: str
    status: str
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class PartResult:
    """One part's checks, the things it skipped (each with the reason) and its wall time."""

    part: str
    device: str
    checks: list[Check] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None
    finished: bool = False  # set once the part's body returned or raised (its process may still be exiting)
    path: Path | None = field(default=None, repr=False)  # written after every change
    started: float = field(default_factory=time.perf_counter, repr=False)
    last: float = field(default_factory=time.perf_counter, repr=False)

    def add(self, name: str, ok: bool, **detail: Any) -> bool:
        """Record a check with the seconds since the previous one (and save, so a part stopped at
        its time limit keeps what it did)."""
        now = time.perf_counter()
        self.checks.append(Check(name, PASS if ok else FAIL, {**detail, "seconds": round(now - self.last, 1)}))
        self.last = now
        self.save()
        return ok

    def skip(self, what: str, why: str) -> None:
        """Record something not run here, and why."""
        self.skipped.append({"what": what, "why": why})
        self.save()

    def save(self) -> None:
        """Write the result so far to `path` as JSON."""
        if self.path is not None:
            self.path.write_text(json.dumps(self.to_json(), indent=1, default=str))

    @property
    def status(self) -> str:
        """fail if anything failed or raised, skip if nothing ran, else pass."""
        if self.error or any(c.status == FAIL for c in self.checks):
            return FAIL
        return PASS if self.checks else SKIP

    def to_json(self) -> dict[str, Any]:
        out = {**asdict(self), "status": self.status}
        for name in ("path", "started", "last"):
            out.pop(name)
        return out


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (imports torch)."""
    import torch

    return torch.cuda.is_available()


def environment() -> dict[str, Any]:
    """Versions and the accelerator, for the report's header."""
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
    }
    for name in ("transformers", "triton", "peft", "accelerate", "bitsandbytes"):
        try:  # the installed version, without importing the package
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name] = "not installed"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_memory_gb"] = round(props.total_memory / 2**30, 1)
        env["sm_count"] = props.multi_processor_count
    return env


def part_main(name: str, body: Callable[[PartResult, argparse.Namespace], None]) -> None:
    """Command line of one part: run `body`, write its result as JSON to --json, whatever happens."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.gpu_check.{name}")
    parser.add_argument("--json", type=Path, required=True, help="where to write this part's result")
    parser.add_argument("--quick", action="store_true", help="the small CPU subset CI runs")
    parser.add_argument("--workdir", type=Path, required=True, help="scratch folder for models")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    device = "cuda" if cuda_available() else "cpu"
    result = PartResult(name, device, path=args.json)
    try:
        body(result, args)
    except Exception:  # noqa: BLE001 - the report says what broke; other parts go on
        result.error = traceback.format_exc()[-4000:]
    result.seconds = round(time.perf_counter() - result.started, 1)
    result.finished = True
    result.save()
    print(f"[gpu-check] {name}: {result.status} in {result.seconds} s", flush=True)
