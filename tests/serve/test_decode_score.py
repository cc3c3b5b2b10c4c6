"""serve.decode_score scores one-row decode steps as transformers scores the sequence, also on a
model whose sliding and full layers keep separate KV block groups (Gemma 3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serve.decode_score import decode_nll
from serve.model import DecoderModel
from tests.serve.conftest import hf_model, make_model
from warsha.random_models import FAMILY_CONFIGS


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_decode_nll_matches_transformers_full_sequence(tmp_path: Path, arch: str) -> None:
    config = FAMILY_CONFIGS.get(arch, {"arch": arch})
    path = make_model(tmp_path / arch, seed=3, **config)
    ours = DecoderModel.load(path, "float32")
    ids = [1] + torch.randint(3, ours.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():  # 40 tokens: past Gemma's 16-token window
        logits = hf_model(path)(torch.tensor([ids])).logits[0].double()
    want = float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum"))
    got = decode_nll(ours, ids, block_size=4)
    assert got == pytest.approx(want, rel=1e-4)
