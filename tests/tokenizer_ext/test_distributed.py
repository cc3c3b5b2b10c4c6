"""Two CPU processes under DeepSpeed ZeRO-2 / ZeRO-3 (launched by torchrun, not accelerate).

Slow: each launch costs about a minute on 2 cores (first run also JIT-compiles DeepSpeed's
CPU ops into ~/.cache/torch_extensions). Run with ``pytest -m slow tests/tokenizer_ext``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def _launch(model_dir: Path, work: Path, config: str) -> dict:
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{HERE}", "OMP_NUM_THREADS": "1"}
    cmd = [
        str(torchrun),
        "--nproc_per_node",
        "2",
        str(HERE / "ds_worker.py"),
        str(model_dir),
        str(work),
        str(ROOT / "recipes" / "deepspeed" / config),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((work / "result.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("config, stage", [("zero2.json", 2), ("zero3.json", 3), ("zero3_offload.json", 3)])
def test_two_process_zero_training(tmp_path: Path, sp_embedded_dir: Path, config: str, stage: int) -> None:
    result = _launch(sp_embedded_dir, tmp_path, config)
    ext = result["extended"]
    assert ext["world_size"] == 2 and ext["zero_stage"] == stage
    curve = ext["loss_curve"]
    assert len(curve) == 6 and curve[-1] < curve[0]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert model.get_input_embeddings().weight.shape[0] >= len(tok)
    assert ext["bits_per_char"]["ar"] > 0


@pytest.mark.slow
def test_zero2_resumes_from_checkpoint(tmp_path: Path, sp_embedded_dir: Path) -> None:
    """A second launch over the same checkpoint directory continues after step 3 of 6."""
    _launch(sp_embedded_dir, tmp_path, "zero2.json")
    again = _launch(sp_embedded_dir, tmp_path, "zero2.json")["extended"]
    assert again["resumed_from_step"] == 3 and len(again["loss_curve"]) == 3


@pytest.mark.slow
def test_zero3_gathered_row_writes(tmp_path: Path) -> None:
    """embed.initialise on ZeRO-3-partitioned weights equals the unpartitioned reference."""
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{HERE}", "OMP_NUM_THREADS": "1"}
    cmd = [str(torchrun), "--nproc_per_node", "2", str(HERE / "zero3_init_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 2 and result["partitioned"] is True
    assert result["max_abs_diff"] < 1e-6
