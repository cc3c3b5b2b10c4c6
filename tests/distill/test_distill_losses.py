"""Divergences against float64 numpy/scipy references, and the top-k cache round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.special import log_softmax, rel_entr

from distill.losses import (
    compress_topk,
    expand_topk,
    masked_mean,
    teacher_logprobs,
    token_divergence,
)


def _reference(s: np.ndarray, t: np.ndarray, kind: str, temp: float) -> np.ndarray:
    q, p = np.exp(log_softmax(s / temp, -1)), np.exp(log_softmax(t / temp, -1))
    if kind == "tvd":
        return 0.5 * np.abs(p - q).sum(-1)
    if kind == "fkl":
        return rel_entr(p, q).sum(-1) * temp**2
    if kind == "rkl":
        return rel_entr(q, p).sum(-1) * temp**2
    m = 0.5 * (p + q)
    return (0.5 * rel_entr(p, m).sum(-1) + 0.5 * rel_entr(q, m).sum(-1)) * temp**2


@pytest.mark.parametrize("kind", ["fkl", "rkl", "tvd", "jsd"])
@pytest.mark.parametrize("temp", [0.5, 1.0, 2.0])
def test_divergences_match_float64_reference(kind: str, temp: float) -> None:
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 5, 50, generator=g) * 3, torch.randn(3, 5, 50, generator=g) * 3
    got = token_divergence(s, teacher_logprobs(t, temp), kind, temp)
    want = _reference(s.double().numpy(), t.double().numpy(), kind, temp)
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["fkl", "rkl", "tvd", "jsd"])
def test_zero_at_equality_and_gradients_flow(kind: str) -> None:
    t = torch.randn(2, 4, 30)
    assert token_divergence(t, teacher_logprobs(t, 1.0), kind).abs().max() < 1e-5
    s = torch.randn(2, 4, 30, requires_grad=True)
    token_divergence(s, teacher_logprobs(t, 1.0), kind).sum().backward()
    assert torch.isfinite(s.grad).all() and s.grad.abs().sum() > 0


def test_tvd_is_one_minus_acceptance() -> None:
    from warsha.speculative import overlap, probs

    s, t = torch.randn(4, 40), torch.randn(4, 40)
    tvd = token_divergence(s, teacher_logprobs(t, 1.0), "tvd")
    torch.testing.assert_close(tvd, 1 - overlap(probs(t, 1.0), probs(s, 1.0)), atol=1e-6, rtol=0)


def test_unknown_loss_and_masked_mean() -> None:
    with pytest.raises(ValueError, match="loss"):
        token_divergence(torch.zeros(2, 3), torch.zeros(2, 3), "kl")
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[True, False, True], [False, False, True]])
    assert float(masked_mean(v, m)) == pytest.approx((1 + 3 + 6) / 3)


def test_topk_cache_keeps_topk_and_spreads_the_rest() -> None:
    lp = teacher_logprobs(torch.randn(2, 3, 100) * 4, 1.0)
    vals, idx = compress_topk(lp, 10)
    full = expand_topk(vals, idx, 100)
    assert torch.allclose(full.exp().sum(-1), torch.ones(2, 3), atol=1e-5)
    torch.testing.assert_close(full.gather(-1, idx.long()), lp.gather(-1, idx.long()))
    rest_mass = 1 - lp.topk(10, -1).values.exp().sum(-1)
    others = full.exp().sum(-1) - full.gather(-1, idx.long()).exp().sum(-1)
    torch.testing.assert_close(others, rest_mass, atol=1e-5, rtol=0)
    # reverse KL stays finite against the cached teacher
    assert torch.isfinite(token_divergence(torch.randn(2, 3, 100), full, "rkl")).all()
