"""Synthetic training rows that teach copying (induction), shared by every stage that needs it.

Why: retrieval over a long context (passkey) is an induction skill: find the earlier occurrence
of the current text and continue it. Real base models acquire it from the repetition in
billions of web tokens; a small model trained for minutes never does. A row that repeats one
span of natural text makes most of its tokens copy targets: the densest copy signal per token.
Measured on the demo model (19M parameters, about 1M training tokens): 400 bootstrap steps with
a quarter of the rows like this did not grow the circuit (top-1 on copy targets stayed equal to
top-1 on first occurrences), so the recipe leaves them off; the option stays for larger runs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def repeat_row(
    source: Sequence[int], length: int, rng: random.Random, bos: int | None
) -> tuple[list[int], list[float]]:
    """BOS + a random span of ``source`` repeated to fill ``length`` tokens, with loss weights.

    Every token of a repeat after the first is a copy target (weight 1); the first copy and the
    first token of each repeat get 0, since nothing earlier predicts them.
    """
    if len(source) < 10:
        raise ValueError(f"repeat_row: the source has {len(source)} tokens; at least 10 are needed")
    span = min(rng.randint(max(8, length // 16), max(9, length // 3)), len(source) - 1)
    start = rng.randrange(len(source) - span)
    return fill_repeats(list(source[start : start + span]), length, bos)


def fill_repeats(seg: Sequence[int], length: int, bos: int | None) -> tuple[list[int], list[float]]:
    """BOS + ``seg`` repeated to ``length`` tokens; weight 1 on each repeat's tokens after its first.

    A repeat's first token follows the previous repeat's last one, which only the span length
    predicts, so it gets 0 like the whole first copy.
    """
    ids = [bos if bos is not None else seg[0]]
    weights = [0.0]
    first = True
    while len(ids) < length:
        take = list(seg[: length - len(ids)])
        weights += [0.0] * len(take) if first else [0.0] + [1.0] * (len(take) - 1)
        ids += take
        first = False
    return ids, weights
