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


def restrict_head(model: Any, ids: Sequence[int]) -> Any:
    """Give ``model`` a frozen head over ``ids`` only (rows copied from its own head) and freeze
    its input embedding; return the original head for ``restore_head``.

    The model's own forward then yields logits over ``ids``, so autocast, DDP and DeepSpeed
    wrappers and any final-logit soft-capping still apply; with a 262k-row head that is most of
    a small model's multiply-adds gone from every training step."""
    original = model.get_output_embeddings()
    model.get_input_embeddings().weight.requires_grad_(False)
    model.set_output_embeddings(_rows_head(original, ids))
    return original


def _rows_head(original: Any, ids: Sequence[int]) -> Any:
    """A frozen ``Linear`` holding the rows ``ids`` of the head ``original`` (copies)."""
    import torch

    index = torch.as_tensor(list(ids), dtype=torch.long)
    rows = original.weight.detach()[index].clone()
    head = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=original.bias is not None)
    head = head.to(device=rows.device, dtype=rows.dtype)
    with torch.no_grad():
        head.weight.copy_(rows)
        if original.bias is not None:
            head.bias.copy_(original.bias.detach()[index])
    return head.requires_grad_(False)


def with_full_head(trained: Any, init: Any) -> Any:
    """A copy of ``init`` (the full-head draft) carrying ``trained``'s weights, all but the
    restricted head ``restrict_head`` put in: the embedding and head stay the ones it froze."""
    import copy

    full = copy.deepcopy(init)
    head = next(n for n, m in trained.named_modules() if m is trained.get_output_embeddings())
    state = {k: v for k, v in trained.state_dict().items() if not k.startswith(head + ".")}
    missing, unexpected = full.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith(head + ".") for k in missing):
        raise RuntimeError(f"draft weights do not fit the full-head draft: {missing} {unexpected}")
    return full


def mask_outside(model: Any, ids: Sequence[int]) -> Any:
    """A view of ``model`` whose logits are ``-inf`` outside ``ids``: the distribution serve's
    restricted draft proposes from, for measuring acceptance as it will be served.

    Like serve, the view multiplies only the ``ids`` rows of the head (the model's own head is
    swapped for the duration of each forward, so soft-capping still applies): with a 262k-row
    head, the full product would make the draft cost most of a target step and the stage's
    speculative timings would describe a draft nobody serves."""
    import torch

    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model
            self.config = model.config
            full = model.get_output_embeddings()
            self.vocab = int(full.weight.shape[0])
            self.register_buffer("index", torch.as_tensor(list(ids), dtype=torch.long), persistent=False)
            self.head = _rows_head(full, ids)

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            full = self.inner.get_output_embeddings()
            self.inner.set_output_embeddings(self.head)
            try:
                out = self.inner(*args, **kwargs)
            finally:
                self.inner.set_output_embeddings(full)
            logits = out.logits.new_full((*out.logits.shape[:-1], self.vocab), float("-inf"))
            logits[..., self.index] = out.logits
            out.logits = logits
            return out

    return Masked()


def write(out_dir: Path, ids: list[int], info: dict[str, Any]) -> None:
    """Write the file the serve engine reads (serve.weights.read_draft_vocab)."""
    (Path(out_dir) / FILE).write_text(json.dumps({"token_ids": ids, **info}))
