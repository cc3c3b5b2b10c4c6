"""The draft's frequent-token vocabulary, written beside the draft for the serving engine.

A small draft spends most of its forward in the vocabulary projection. Serving can compute
draft logits for the N most frequent tokens only (the target seldom picks the others, and the
rejection sampler stays exact because the draft's distribution is still a distribution). The
file is `draft_vocab.json`: `{"token_ids": [...], ...}`, most frequent first; the checkpoint
itself keeps its full head, so transformers and other engines load the draft unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FILE = "draft_vocab.json"


def frequent_tokens(docs: Sequence[Sequence[int]], size: int, always: Sequence[int] = ()) -> list[int]:
    """The `size` most frequent ids of `docs` (ties by lower id), with `always` ids first."""
    counts: dict[int, int] = {}
    for doc in docs:
        for t in doc:
            counts[t] = counts.get(t, 0) + 1
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    keep = list(dict.fromkeys(list(always) + ranked))
    return keep[:size]


def coverage(docs: Sequence[Sequence[int]], ids: Sequence[int]) -> float:
    """Share of the tokens of `docs` that lie in `ids` (an upper bound on what a restricted
    draft can propose correctly)."""
    keep = set(ids)
    total = sum(len(d) for d in docs)
    return sum(t in keep for d in docs for t in d) / max(total, 1)


def write(out_dir: Path, ids: list[int], info: dict[str, Any]) -> None:
    """Write the file the serve engine reads (serve.weights.read_draft_vocab)."""
    (Path(out_dir) / FILE).write_text(json.dumps({"token_ids": ids, **info}))
