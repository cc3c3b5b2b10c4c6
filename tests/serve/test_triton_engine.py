"""The whole engine on the Triton backend (attention, cache write, int4 GEMM) against the torch
backend, token for token, on every served family.

On CPU the Triton kernels run under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 where there is no NVIDIA device); on a CUDA machine they run compiled, on
the GPU. Each run switches on prefix caching, chunked prefill, preemption and speculative
decoding with a same-family layer-skip draft (`warsha.engine_check`); int4 checkpoints go
through `Int4TritonLinear` on the Triton side and serve's CPU int4 kernels (float activations)
on the torch side. Models and workloads stay tiny: the interpreter runs each program in Python.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from warsha.engine_check import Workload, run_engine
from warsha.random_models import FAMILY_CONFIGS, gptq_pair, make_layer_skip_draft, make_model

FAMILIES = {"llama": dict(arch="llama"), **FAMILY_CONFIGS}
WORKLOAD = Workload(num_prompts=3, shared_prefix=10, suffix=4, max_tokens=6, max_num_batched_tokens=12)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pair(root: Path, family: str) -> tuple[Path, Path]:
    target = make_model(root / "target", seed=7, **FAMILIES[family])
    return target, make_layer_skip_draft(target, root / "draft", num_layers=1)


def _both(target: Path, draft: Path, **options: object) -> tuple[dict, dict]:
    """The same workload through the engine on each attention backend."""
    runs = {
        name: run_engine(target, draft, WORKLOAD, device=DEVICE, attention_backend=name, **options)
        for name in ("triton", "torch")
    }
    return runs["triton"], runs["torch"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_triton_engine_matches_torch_engine(family: str, tmp_path: Path) -> None:
    """float32, every path on: identical tokens, and each path was really taken."""
    target, draft = _pair(tmp_path, family)
    triton_run, torch_run = _both(target, draft, dtype="float32")
    assert triton_run["tokens"] == torch_run["tokens"]
    assert all(len(t) == WORKLOAD.max_tokens for t in triton_run["tokens"])
    assert triton_run["prefix_hit_tokens"] > 0 and triton_run["preemptions"] > 0
    assert triton_run["drafted"] > 0 and triton_run["accepted"] > 0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_triton_int4_engine_matches_torch_engine(family: str, tmp_path: Path) -> None:
    """A GPTQ int4 checkpoint (and its int4 draft): Int4TritonLinear against serve's CPU int4
    kernels with float activations, greedy tokens identical."""
    base = make_model(tmp_path / "base", seed=7, **FAMILIES[family])
    qdir, _ = gptq_pair(base, tmp_path / "gptq")
    draft = make_layer_skip_draft(qdir, tmp_path / "draft", num_layers=1)
    triton_run, torch_run = _both(qdir, draft, dtype="float32", int4_activations="float")
    assert triton_run["tokens"] == torch_run["tokens"]
    assert triton_run["preemptions"] > 0 and triton_run["accepted"] > 0
