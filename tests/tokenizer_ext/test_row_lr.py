"""Per-row learning rates against AdamW run on the rows as separate parameters (float64)."""

from __future__ import annotations

import pytest
import torch

from tokenizer_ext.row_lr import scale_leading_rows, scale_rows


def _loss(w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((w.sin() - target) ** 2).sum() + w[:, 0].prod()


@pytest.mark.parametrize("scale", [0.0, 0.1, 0.5])
def test_scaled_rows_match_adamw_at_the_scaled_rate(scale: float) -> None:
    torch.manual_seed(0)
    start, target = torch.randn(10, 4, dtype=torch.float64), torch.randn(10, 4, dtype=torch.float64)
    lr, wd, rows = 0.05, 0.01, 6
    w = torch.nn.Parameter(start.clone())
    opt = torch.optim.AdamW([w], lr=lr, weight_decay=wd)
    scale_leading_rows(opt, w, rows, scale)
    top, rest = torch.nn.Parameter(start[:rows].clone()), torch.nn.Parameter(start[rows:].clone())
    ref = torch.optim.AdamW([{"params": [top], "lr": lr * scale}, {"params": [rest], "lr": lr}], weight_decay=wd)
    for _ in range(5):
        for o, loss in ((opt, _loss(w, target)), (ref, _loss(torch.cat([top, rest]), target))):
            o.zero_grad()
            loss.backward()
            o.step()
    torch.testing.assert_close(w.detach(), torch.cat([top, rest]).detach(), rtol=1e-12, atol=1e-12)
    assert not torch.equal(w.detach()[rows:], start[rows:])
    assert torch.equal(w.detach()[:rows], start[:rows]) == (scale == 0.0)


def test_rejects_a_scale_outside_0_1() -> None:
    w = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="scale must be in"):
        scale_leading_rows(torch.optim.AdamW([w]), w, 1, 1.5)


def test_a_middle_range_and_a_range_to_the_end_match_adamw() -> None:
    """Rows 0-2 at 0.1x and rows 5- at 0.3x, the rest at lr: AdamW with three groups."""
    torch.manual_seed(1)
    start, target = torch.randn(9, 3, dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)
    lr = 0.05
    w = torch.nn.Parameter(start.clone())
    opt = torch.optim.AdamW([w], lr=lr)
    scale_rows(opt, w, 0, 2, 0.1)
    scale_rows(opt, w, 5, None, 0.3)
    parts = [torch.nn.Parameter(start[a:b].clone()) for a, b in ((0, 2), (2, 5), (5, 9))]
    ref = torch.optim.AdamW([{"params": [q], "lr": lr * s} for q, s in zip(parts, (0.1, 1.0, 0.3))])
    for _ in range(4):
        for o, loss in ((opt, _loss(w, target)), (ref, _loss(torch.cat(parts), target))):
            o.zero_grad()
            loss.backward()
            o.step()
    torch.testing.assert_close(w.detach(), torch.cat(parts).detach(), rtol=1e-12, atol=1e-12)
