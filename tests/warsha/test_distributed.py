"""Bootstrap training with 2 CPU processes: a real world size of 2, ranks in sync, rank 0 writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from warsha import artifacts


def test_two_process_bootstrap(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        "29517",
        str(REPO / "tests" / "warsha" / "dist_worker.py"),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in (0, 1):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert seen == {"world": 2, "same_ok": True, "divergence_caught": True}
    m = artifacts.read_manifest(tmp_path / "bootstrap")
    assert m["world_size"] == 2
    assert m["metrics"]["train"]["world_size"] == 2  # training saw both ranks
    # The trainer raises if parameters differ across ranks; reaching here means they matched.
    assert artifacts.verify(tmp_path / "bootstrap") == m["digest"]


def test_leave_flushes_and_exits_with_the_code() -> None:
    """A launched process ends through os._exit: what it printed and logged must still arrive."""
    code = (
        "import logging, sys\n"
        "from warsha import distributed\n"
        "logging.basicConfig(stream=sys.stderr)\n"
        "print('written', end='')\n"
        "logging.getLogger('w').warning('logged')\n"
        "distributed.leave(3)\n"
        "print('never')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 3 and proc.stdout == "written" and "logged" in proc.stderr
