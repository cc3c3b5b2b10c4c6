"""Shared fixtures: offline environment and a tiny recipe every core test can run in seconds."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

for _key, _value in (
    ("HF_HUB_OFFLINE", "1"),
    ("HF_DATASETS_OFFLINE", "1"),
    ("TRANSFORMERS_OFFLINE", "1"),
    ("WANDB_MODE", "offline"),
    ("WANDB_SILENT", "true"),
    ("TOKENIZERS_PARALLELISM", "false"),
):
    os.environ.setdefault(_key, _value)

# serve's Triton kernels are tested on CPU through Triton's interpreter. Triton reads
# TRITON_INTERPRET when it decorates kernels, its own tl.* helpers included (decorated when
# triton is first imported), and again at launch; peft, bitsandbytes and torch._dynamo import
# triton as a side effect, so the variable must be set here, before any test module is collected.
# It changes nothing else on a machine without CUDA (no other code runs triton kernels there);
# with CUDA it is left unset so the compiled kernels are tested. Runs in tests/serve/test_triton_*.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from warsha import runtime  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """The allocator and thread policy of every training process (warsha.runtime), before the first tensor.

    Where tcmalloc is installed the session restarts once with it preloaded; pytest's output
    capture is suspended first, or the restarted session would write into the capture's files.
    Its ``LD_PRELOAD`` (or glibc-tuned's ``MALLOC_*_``) reaches the workers the tests launch.
    """
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)
    runtime.apply(reexec=True)
    if capture is not None:
        capture.resume_global_capture()


REPO = Path(__file__).resolve().parents[1]


def tiny_recipe(name: str = "tiny", steps: int = 4, **bootstrap: Any) -> dict[str, Any]:
    """A recipe whose bootstrap stage trains a 1-layer, 32-wide model for a few steps."""
    params = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_layers": 1,
        "num_heads": 2,
        "num_kv_heads": 1,
        "max_position_embeddings": 64,
        "max_train_tokens": 20000,
        "eval_documents": 4,
        "train": {
            "steps": steps,
            "batch_size": 2,
            "seq_len": 32,
            "lr": 0.01,
            "warmup_steps": 1,
            "checkpoint_every": 2,
            "bf16": False,
        },
    }
    params.update(bootstrap)
    return {
        "name": name,
        "data": {"collections": ["bukhari"], "max_documents": 600},
        "tracking": {"backend": "none"},
        "device": "cpu",
        "stages": [{"stage": "bootstrap", "params": params}],
    }


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished bootstrap artifact (tiny model), built once per test session."""
    from warsha import pipeline
    from warsha.config import parse_recipe

    root = tmp_path_factory.mktemp("tiny-run")
    recipe = parse_recipe(tiny_recipe())
    steps = pipeline.plan(recipe, root)
    pipeline.Runner(recipe, root).run(steps, {0})
    return root / "bootstrap"
