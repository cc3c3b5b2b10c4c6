"""A slower learning rate for some rows of one parameter: the base vocabulary's rows of a
trained embedding move at a fraction of the step the new rows take.

Why: Adam sizes every element's step to about the learning rate whatever its gradient, and a
tied head hands every row a gradient at every step (the softmax reaches all of them), so rows
the training text never shows (digits, other scripts) drift as far as the rows being taught.
The gradient cannot slow Adam down (it divides the scale out), so the step itself is scaled:
the rows are remembered before the optimizer steps and pulled back towards where they were
after it. AdamW's step, weight decay included, is linear in the learning rate and its moment
estimates do not depend on it, so this is exactly AdamW at ``scale`` times the rate for those
rows, with one copy of the rows per step as its price.
"""

from __future__ import annotations

from typing import Any


def scale_leading_rows(optimizer: Any, weight: Any, rows: int, scale: float) -> None:
    """Make ``optimizer`` move ``weight[:rows]`` by ``scale`` times its own step from now on."""
    scale_rows(optimizer, weight, 0, rows, scale)


def scale_rows(optimizer: Any, weight: Any, start: int, end: int | None, scale: float) -> None:
    """Make ``optimizer`` move ``weight[start:end]`` by ``scale`` times its own step from now on.

    ``optimizer`` is the torch optimizer itself (hooks on a wrapper such as accelerate's would
    fire also on the steps gradient accumulation skips). The range is clipped to the weight's
    rows (``end`` None: to the last row).
    """
    import torch

    if not 0.0 <= scale <= 1.0:
        raise ValueError(f"row learning-rate scale must be in [0, 1], got {scale}")
    rows = slice(min(start, weight.shape[0]), weight.shape[0] if end is None else min(end, weight.shape[0]))
    saved: list[torch.Tensor] = []

    def before(*_: Any) -> None:
        saved.append(weight.detach()[rows].clone())

    def after(*_: Any) -> None:
        old = saved.pop()
        with torch.no_grad():
            weight[rows].sub_(old).mul_(scale).add_(old)  # old + scale * (stepped - old)

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
