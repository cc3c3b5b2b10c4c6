"""warsha.sampling.draw against the exact distribution, zeros never drawn, reproducible."""

from __future__ import annotations

import pytest
import torch

from warsha.sampling import draw


def test_draw_matches_the_distribution() -> None:
    """200,000 draws of a row with a zero, a tiny and a large entry: each frequency within five
    binomial standard errors of its probability; the zero never drawn; unnormalised rows fine."""
    p = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.049, 0.001])
    rows = 200_000
    gen = torch.Generator().manual_seed(0)
    got = draw((p * 3).expand(rows, -1), gen).squeeze(1)
    freq = torch.bincount(got, minlength=len(p)).double() / rows
    se = (p.double() * (1 - p.double()) / rows).sqrt()
    assert freq[1] == 0
    assert ((freq - p.double()).abs() <= 5 * se + 1e-12).all(), (freq, p)


def test_draw_is_reproducible_and_one_per_row() -> None:
    probs = torch.softmax(torch.randn(7, 1000, generator=torch.Generator().manual_seed(1)), -1)
    a = draw(probs, torch.Generator().manual_seed(3))
    b = draw(probs, torch.Generator().manual_seed(3))
    assert a.shape == (7, 1) and a.dtype == torch.int64 and torch.equal(a, b)
    with pytest.raises(ValueError, match=r"\[rows, n\]"):
        draw(probs[0])
