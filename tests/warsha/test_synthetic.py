"""Copy rows: every weighted target is predictable by copying; bootstrap batches stay pure
functions of the step and train the weighted loss that a float64 brute force computes."""

from __future__ import annotations

import random

import pytest
import torch

from warsha.bootstrap import BootstrapBatches
from warsha.synthetic import repeat_row
from warsha.training import causal_lm_loss


@pytest.mark.parametrize("length", [32, 256, 1024])
def test_weighted_targets_repeat_an_earlier_bigram(length: int) -> None:
    source = [random.Random(1).randrange(3, 500) for _ in range(3000)]
    ids, w = repeat_row(source, length, random.Random(length), 1)
    assert len(ids) == len(w) == length and ids[0] == 1
    marked = [i for i, x in enumerate(w) if x > 0]
    assert len(marked) >= length // 3
    for i in marked:  # brute force: (previous token, token) occurred before position i - 1
        assert any(ids[j - 1] == ids[i - 1] and ids[j] == ids[i] for j in range(2, i - 1))


def test_short_source_is_refused() -> None:
    with pytest.raises(ValueError, match="source"):
        repeat_row([5, 6, 7], 64, random.Random(0), 1)


def test_bootstrap_batches_mix_copy_rows_deterministically() -> None:
    stream = torch.randint(3, 1000, (20_000,), generator=torch.Generator().manual_seed(0))
    batches = BootstrapBatches(stream, 16, 64, 0, 0.5, 1)
    a, b = batches(3, 0, 0), batches(3, 0, 0)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_weights"], b["loss_weights"])
    copy_rows = (a["loss_weights"] == 0).any(dim=1)
    assert 0 < int(copy_rows.sum()) < 16
    assert (a["input_ids"][copy_rows, 0] == 1).all()
    assert (a["loss_weights"][~copy_rows] == 1).all()
    assert "loss_weights" not in BootstrapBatches(stream, 4, 64, 0, 0.0, 1)(3, 0, 0)


def test_weighted_loss_matches_float64_brute_force() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg).double().eval()
    stream = torch.randint(3, 300, (5000,), generator=torch.Generator().manual_seed(1))
    batch = BootstrapBatches(stream, 6, 48, 0, 0.5, 1)(0, 0, 0)
    ids, w = batch["input_ids"], batch["loss_weights"].double()
    total = weight = 0.0
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits, -1)
        for r in range(ids.shape[0]):
            for t in range(1, ids.shape[1]):
                total -= float(w[r, t] * logp[r, t - 1, ids[r, t]])
                weight += float(w[r, t])
        got = float(causal_lm_loss(model, batch))
    assert got == pytest.approx(total / weight, rel=1e-6)
