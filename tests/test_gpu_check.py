"""`python -m benchmarks.gpu_check --quick`: the GPU check's CPU mode runs and reports.

Run as a subprocess (tests never import `benchmarks`). Without CUDA the engine part runs on the
Triton backend under the interpreter against transformers, the training step runs on the CPU
in bf16 against float32, serve.validate runs plain against draft, and the throughput part is
skipped with its reason in both reports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_quick_mode_runs_and_names_its_skips(tmp_path: Path) -> None:
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--quick", "--parts", "engine,train,validate,speed"]
    proc = subprocess.run(cmd + ["--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=3600)
    report = json.loads((out / "report.json").read_text())
    parts = {p["part"]: p for p in report["parts"]}
    assert proc.returncode == 0 and report["status"] == "pass", json.dumps(report, indent=1)[-4000:]
    engine = parts["engine"]["checks"][0]
    assert engine["status"] == "pass" and engine["detail"]["identical"] == engine["detail"]["of"] > 0
    assert engine["detail"]["preemptions"] > 0 and engine["detail"]["prefix_hit_tokens"] > 0
    assert all(c["status"] == "pass" for c in parts["train"]["checks"] + parts["validate"]["checks"])
    markdown = (out / "report.md").read_text()
    if not torch.cuda.is_available():
        assert parts["speed"]["status"] == "skip" and parts["speed"]["skipped"][0]["why"] == "no CUDA device"
        assert "no CUDA device" in markdown and "TinyLlama" in markdown


def test_decode_rate_subtracts_the_prefill_run() -> None:
    """n tokens over (time of n + 1 tokens) minus (time of 1): a 2 ms step and a 50 ms prefill
    give 500 tokens/s whatever the prefill costs."""
    from benchmarks.gpu_check.speed import decode_rate

    calls: list[int] = []

    def run(k: int) -> float:
        calls.append(k)
        return 0.05 + 0.002 * (k - 1)

    assert decode_rate(run, n=256) == 500.0
    assert calls[0] == 8 and set(calls[1:]) == {1, 257}


def test_a_part_stopped_while_exiting_keeps_its_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A part whose checks all finished but whose process outlived its limit (CUDA teardown: the
    first H200 run's validate part) keeps its verdict with a note; one stopped mid-work fails."""
    import subprocess as sp

    from benchmarks.gpu_check import __main__ as runner

    class Stuck:
        """A part process that wrote its result and then never exits."""

        def __init__(self, cmd: list[str], **_: object) -> None:
            self.pid = 0
            self.json = Path(cmd[cmd.index("--json") + 1])
            self.json.write_text(json.dumps({"part": "validate", "status": "pass", "checks": [], "finished": finished}))

        def wait(self, timeout: float | None = None) -> int:
            if timeout is not None:
                raise sp.TimeoutExpired("part", timeout)
            return -9

    monkeypatch.setattr(runner.subprocess, "Popen", Stuck)
    monkeypatch.setattr(runner.os, "killpg", lambda pid, sig: None)
    finished = True
    done = runner.run_part("validate", tmp_path, quick=True, cuda=True)
    assert done["status"] == "pass" and "still exiting" in done["note"]
    finished = False
    cut = runner.run_part("validate", tmp_path, quick=True, cuda=True)
    assert cut["status"] == "fail" and "timed out" in cut["error"]
