"""Slow end-to-end checks, kept out of the default run (`pytest -m slow`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_benchmark_quick_run_writes_results(tmp_path: Path) -> None:
    """The benchmark runs end to end on CPU and writes the fields the report reads (no timing checks)."""
    before = set((ROOT / "benchmarks" / "results").glob("*.json"))
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.serve_bench",
        "--quick",
        "--no-medium",
        "--skip-cb",
        "--repeats",
        "1",
        "--scenarios",
        "a,b",
        "--workdir",
        str(tmp_path),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    new = sorted(set((ROOT / "benchmarks" / "results").glob("*.json")) - before)
    assert new, "no results file written"
    data = json.loads(new[-1].read_text())
    assert data["a"]["identical_to_hf_fp32_subset"] == 1.0
    assert data["a"]["warsha"]["tok_per_s"] > 0 and data["b"]["small_warsha_bf16_tok_s"] > 0
    for f in new:
        f.unlink()


@pytest.mark.slow
def test_bf16_engine_tracks_hf_generate(tiny_dir: Path) -> None:
    """bf16 greedy outputs agree with HF bf16 at batch 1 on most tokens (rounding may flip near-ties)."""
    import torch

    from serve import LLM, SamplingParams
    from tests.serve.conftest import hf_model

    bf16_dir = tiny_dir
    ref = hf_model(bf16_dir, torch.bfloat16)
    llm = LLM(bf16_dir, dtype="bfloat16")
    prompts = [[3 + i, 40 + i, 77, 100 + 2 * i, 5] for i in range(10)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    agree = 0
    for p, o in zip(prompts, outs):
        want = ref.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False)[
            0, len(p) :
        ].tolist()
        agree += next((i for i in range(16) if want[i] != o.token_ids[i]), 16)
    assert agree / (16 * len(prompts)) > 0.5
    llm.block_manager.check_no_leaks()


@pytest.mark.slow
def test_reliability_load_test_small(tmp_path: Path) -> None:
    """``python -m benchmarks.serve_reliability`` scaled down (60 concurrent streams, 10% hostile, a pool for 20
    sequences): every well-formed stream identical to its run alone, no 5xx, no leaked block."""
    import os
    import re

    from tests.serve.conftest import make_model

    make_model(tmp_path / "model", seed=5, max_position_embeddings=256)
    cmd = [sys.executable, "-m", "benchmarks.serve_reliability", "--requests", "60", "--max-tokens", "16", "--no-save"]
    cmd += ["--model-dir", str(tmp_path / "model")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, cwd=ROOT)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    for row, value in (
        ("well-formed identical to alone", "54"),
        ("well-formed 5xx", "0"),
        ("hostile with unexpected status", "0"),
        ("KV blocks leaked when idle", "0"),
        ("PASSED", "True"),
    ):
        assert re.search(rf"^{re.escape(row)}\s+{value}$", out, re.M), (row, out)
