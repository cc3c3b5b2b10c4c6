"""Prompt lookup: draft tokens copied from the request's own context, without a model.

If the last n tokens of a request (prompt and output so far) occurred earlier in it, the tokens
that followed that earlier occurrence are a free guess at what comes next (Saxena's prompt
lookup decoding; vLLM's ``ngram`` method). It pays where text repeats: quoting or editing the
prompt, lists, code, and the loops a base model falls into when decoding greedily, which is
where a small distilled draft agrees with its target least. With a draft model beside it the
engine uses a lookup when one is found and the draft otherwise (`serve.runner`).

The longest suffix from ``max_n`` down to ``min_n`` wins; among its earlier occurrences the
most recent, because a loop repeats its latest turn; a loop shorter than the window is copied
round again to fill it.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the context's suffix.

    Empty when no suffix of ``min_n``..``max_n`` tokens occurred before, or ``k`` is 0."""
    size = len(tokens)
    if k < 1 or size <= min_n:
        return []
    ids = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # windows starting at 0..size-n-1: every n-gram but the suffix itself
        windows = sliding_window_view(ids[: size - 1], n)
        hits = np.flatnonzero((windows == ids[size - n :]).all(axis=1))
        if hits.size:
            return _continue(tokens, int(hits[-1]) + n, k)
    return []


def _continue(tokens: list[int], start: int, k: int) -> list[int]:
    """``k`` tokens from ``start`` on; past the end of the context the copy continues into its
    own output, so a loop shorter than ``k`` is proposed for the whole window."""
    out: list[int] = []
    size = len(tokens)
    for i in range(start, start + k):
        out.append(tokens[i] if i < size else out[i - size])
    return out
