"""Fixtures: tiny random Llama-family checkpoints and a byte-level BPE tokenizer, built in-process.

transformers is used here only as the independent reference; `serve` itself never imports it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from serve import cpu_kernels
from warsha.random_models import (  # noqa: F401  (re-exported: the serve tests import them from here)
    ARCHS,
    CORPUS,
    hf_model,
    make_layer_skip_draft,
    make_model,
    write_tokenizer,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Tiny ops on a shared 2-core machine: extra OpenMP threads only wait on each other.
torch.set_num_threads(1)


@pytest.fixture(params=cpu_kernels.supported_isas())
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each kernel variant this CPU runs, in turn (`WARSHA_CPU_ISA`'s choices; the loaded one is
    restored after). Request it, or mark a module with `pytest.mark.usefixtures("isa")`."""
    with cpu_kernels.use_isa(request.param):
        yield request.param


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny Llama (fp32 weights)."""
    return make_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def spec_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 3-layer target whose later layers are damped, and its 1-layer layer-skip draft."""
    target = make_model(tmp_path_factory.mktemp("spec_target"), seed=3, num_hidden_layers=3, _damp_layers_from=1)
    return target, make_layer_skip_draft(target, tmp_path_factory.mktemp("spec_draft"))


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller draft with the same tokenizer."""
    return make_model(
        tmp_path_factory.mktemp("draft"),
        seed=1,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
