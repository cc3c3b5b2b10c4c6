"""Metrics against brute-force references."""

from __future__ import annotations

import math

import pytest
import torch

from warsha.evaluate import fertility, likelihood, windows


@pytest.mark.parametrize(
    "n,length,stride", [(1, 8, 4), (2, 8, 4), (8, 8, 4), (9, 8, 4), (50, 8, 4), (50, 16, 1), (33, 16, 15)]
)
def test_windows_score_every_target_once(n: int, length: int, stride: int) -> None:
    scored: list[int] = []
    for begin, end, k in windows(n, length, stride):
        assert end - begin <= length and 0 < k <= end - begin - (1 if begin == 0 else 0)
        scored += list(range(end - k, end))
    assert scored == list(range(1, n))


def test_fertility_counts() -> None:
    f = fertility(lambda texts: [list(range(len(t.split()) * 2)) for t in texts], ["a b", "c d e"])
    assert (f.tokens, f.words, f.chars) == (10, 5, 8)
    assert f.tokens_per_word == 2.0 and f.chars_per_token == 0.8


def full_context_nll(model, ids: list[int]) -> float:
    """Brute force: each target's log-probability from a forward over exactly its prefix."""
    total = 0.0
    with torch.no_grad():
        for t in range(1, len(ids)):
            logits = model(torch.tensor([ids[:t]])).logits[0, -1]
            total -= float(torch.log_softmax(logits, -1)[ids[t]])
    return total


@pytest.mark.parametrize("bounded", [False, True])
def test_likelihood_matches_brute_force_float64(tiny_artifact, monkeypatch, bounded: bool) -> None:
    """Also with the logits budget forcing one row per forward and 3-position softmax chunks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_artifact, dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(tiny_artifact)
    texts = ["Narrated Abu Huraira: the Prophet said something.", "قال رسول الله", "x", "and then he said"]
    if bounded:
        monkeypatch.setattr("warsha.evaluate.LOGITS_BUDGET_BYTES", 1)
        monkeypatch.setattr("warsha.score_forward.NLL_POSITIONS", 3)
    got = likelihood(model, tok, texts, max_length=64, batch_size=3)
    ref = sum(full_context_nll(model, [tok.bos_token_id] + tok(t, add_special_tokens=False).input_ids) for t in texts)
    assert got.nll_nats == pytest.approx(ref, rel=1e-9)
    chars = sum(len(t) for t in texts)
    assert got.bits_per_char == pytest.approx(ref / math.log(2) / chars, rel=1e-9)
    assert got.tokens == sum(len(tok(t, add_special_tokens=False).input_ids) for t in texts)


def test_long_text_windows_score_each_token_with_bounded_context(tiny_artifact) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_artifact, dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(tiny_artifact)
    text = "Narrated Abu Huraira: the Prophet said something long enough to need windows. " * 2
    ids = [tok.bos_token_id] + tok(text, add_special_tokens=False).input_ids
    full = likelihood(model, tok, [text], max_length=len(ids))
    windowed = likelihood(model, tok, [text], max_length=16, stride=8)
    assert full.nll_nats == pytest.approx(full_context_nll(model, ids), rel=1e-9)
    assert windowed.tokens == full.tokens
    assert windowed.nll_nats != pytest.approx(full.nll_nats, rel=1e-6)  # context really was cut
