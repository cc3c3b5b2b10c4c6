"""Sliding-window perplexity against a brute-force float64 reference, one forward per target.

The stage's perplexity table was flat across lengths on the demo model; this pins down that
the flatness is the model's (it barely uses context beyond ~128 tokens) and not the scorer:
the window length, the positions (each window restarts at 0, padded rows included) and the
stride (each target scored exactly once, by the window whose last ``stride`` targets hold it)
are all checked against a loop that shares none of the scorer's code.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch


class _IdTokenizer:
    """Texts are space-separated token ids: the scorer sees exactly the ids we chose."""

    bos_token_id = 1

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict[str, list[list[int]]]:
        return {"input_ids": [[int(t) for t in text.split()] for text in texts]}


@pytest.fixture(scope="module")
def model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    m = LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():  # sharpen attention so that context and positions change the scores
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
    return m


def brute_force_nll(model: Any, doc: list[int], max_length: int, stride: int) -> float:
    """Sum of -log p(doc[t] | doc[begin_t:t]) over t >= 1, one unpadded forward per target.

    Window k spans [k*stride, k*stride + max_length); the first scores every target in it, each
    later one only targets no earlier window reached, so target t >= max_length is scored with
    context from begin_t = ceil((t + 1 - max_length) / stride) * stride.
    """
    total = 0.0
    for t in range(1, len(doc)):
        begin = 0 if t < max_length else math.ceil((t + 1 - max_length) / stride) * stride
        ids = torch.tensor([doc[begin : t + 1]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -2].double()
        total -= float(torch.log_softmax(logits, -1)[doc[t]])
    return total


@pytest.mark.parametrize("max_length,stride", [(16, 8), (32, 16), (32, 5)])
def test_likelihood_matches_brute_force_windows(model: Any, max_length: int, stride: int) -> None:
    from warsha.evaluate import likelihood

    gen = torch.Generator().manual_seed(max_length + stride)
    docs = [[1] + torch.randint(3, 50, (n,), generator=gen).tolist() for n in (90, 57, 13)]
    texts = [" ".join(map(str, d[1:])) for d in docs]
    got = likelihood(model, _IdTokenizer(), texts, max_length, batch_size=3, stride=stride)
    ref = sum(brute_force_nll(model, d, max_length, stride) for d in docs)
    assert got.tokens == sum(len(d) - 1 for d in docs)
    assert got.nll_nats == pytest.approx(ref, rel=1e-9)


def test_window_length_is_applied(model: Any) -> None:
    """A position- and context-sensitive model scores the same text differently per length; a
    scorer that ignored the window (the suspected bug) would give one figure for all lengths."""
    from warsha.evaluate import likelihood

    gen = torch.Generator().manual_seed(7)
    text = " ".join(map(str, torch.randint(3, 50, (200,), generator=gen).tolist()))
    ppl = {n: likelihood(model, _IdTokenizer(), [text], n, batch_size=4).perplexity for n in (8, 32, 128)}
    assert len({round(v, 6) for v in ppl.values()}) == 3
    # beyond the trained 64 positions the unscaled random model is scored on unseen positions
    ref = math.exp(brute_force_nll(model, [1] + [int(t) for t in text.split()], 128, 64) / 200)
    assert ppl[128] == pytest.approx(ref, rel=1e-9)
