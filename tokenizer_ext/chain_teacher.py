"""The second level of the chain-rule teacher: how the base splits its next token's mass among
the new pieces that start with it (``tokenizer_ext.embed``'s ``fit_chain_weight``).

Why: the aggregated cross-entropy of ``cross_tok`` is exact for the first base token of what
follows, and leaves the split between that token and the new pieces starting with it to the
next-token loss, which only sees the piece the text actually used. A new piece that a text from
another domain needs is mostly one the corpus rarely shows, so nothing teaches it as an output;
that is where the extended model loses most outside the corpus (docs/adaptation.md, "What the map
leaves"). The base knows the answer for every such piece at once: where both models have read
the same text and the base's next token is ``b``, the base's probability that a piece ``b s ...``
comes next is ``p(b) p(s | b)`` by the chain rule, and ``p(s | b)`` is the base's own next-token
distribution one position later, which the teacher's forward already computed. So, given that
the extended model writes something starting with ``b``, its conditional mass on the pieces
whose second base id is ``s`` is trained towards ``p(s | b)``, and its mass on ``b`` alone towards
what is left. Every piece starting with ``b`` learns, seen or not.

Pieces are grouped by their first two base ids; a longer piece shares its group with the
shorter ones of the same start (its own split further is a third level, not taken here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

TEACHER_CHUNK = 256  # teacher rows per head product: [256, 262k] float32 is 268 MB


@dataclass(frozen=True)
class ChainGroups:
    """The new pieces (``first_new`` on, in id order) by their first two base ids."""

    first_new: int
    firsts: torch.Tensor  # [n]: each piece's first base id (-1: a split shorter than two)
    group: torch.Tensor  # [n]: each piece's group, or 0 for those without one (masked by firsts)
    group_first: torch.Tensor  # [G]
    group_second: torch.Tensor  # [G]


def chain_groups(sources: Sequence[Sequence[int]], first_new: int) -> ChainGroups:
    """Group ``sources`` (each new id's base split, ``embed.base_splits``) by their first two ids."""
    index: dict[tuple[int, int], int] = {}
    firsts, group = [], []
    for ids in sources:
        if len(ids) < 2:
            firsts.append(-1), group.append(0)
            continue
        firsts.append(ids[0])
        group.append(index.setdefault((ids[0], ids[1]), len(index)))
    keys = list(index) or [(-1, -1)]
    return ChainGroups(
        first_new,
        torch.tensor(firsts, dtype=torch.long),
        torch.tensor(group, dtype=torch.long),
        torch.tensor([a for a, _ in keys], dtype=torch.long),
        torch.tensor([b for _, b in keys], dtype=torch.long),
    )


def to(groups: ChainGroups, device: torch.device) -> ChainGroups:
    """``groups`` with its tensors on ``device``."""
    return ChainGroups(
        groups.first_new,
        *(t.to(device) for t in (groups.firsts, groups.group, groups.group_first, groups.group_second)),
    )


@torch.no_grad()
def second_logprobs(hidden: torch.Tensor, head: torch.Tensor | None, columns: torch.Tensor) -> torch.Tensor:
    """[rows, len(columns)]: the teacher's log-probabilities of ``columns`` from its final hidden
    states ``hidden`` [rows, d] (or its logits, where ``head`` is None), normalised over its whole
    vocabulary in chunks of rows."""
    out = []
    for lo in range(0, hidden.shape[0], TEACHER_CHUNK):
        h = hidden[lo : lo + TEACHER_CHUNK].float()
        logits = h if head is None else h @ head.float().t()
        out.append(logits[:, columns] - torch.logsumexp(logits, -1, keepdim=True))
    return torch.cat(out) if out else hidden.new_zeros(0, len(columns))


def chain_ce(
    new_logits: torch.Tensor, next_logits: torch.Tensor, nxt: torch.Tensor, groups: ChainGroups, teacher: torch.Tensor
) -> torch.Tensor:
    """Summed cross-entropy over rows of the second level, and only over rows whose next base
    id ``nxt`` [rows] starts some new piece (the rest have nothing to split).

    ``new_logits`` [rows, n]: the extended model's logits of the new pieces; ``next_logits``
    [rows]: its logit of ``nxt`` itself; ``teacher`` [rows, G]: the base's log-probability of each
    group's second id one position after ``nxt`` (``second_logprobs``). Given a piece starting
    with ``nxt`` or ``nxt`` alone, the model's mass on group ``g`` (of ``nxt``) is trained towards
    ``p(second_g | nxt)`` and ``nxt`` alone towards ``1 - sum`` of those."""
    starts = groups.firsts[None, :] == nxt[:, None]  # [rows, n]
    keep = starts.any(1)
    if not bool(keep.any()):
        return new_logits.sum() * 0.0
    starts, nxt_logit, new = starts[keep], next_logits[keep].float(), new_logits[keep].float()
    logq = torch.log_softmax(torch.cat([nxt_logit[:, None], new.masked_fill(~starts, float("-inf"))], 1), 1)
    mass = logq.new_zeros(len(new), len(groups.group_first))
    mass = mass.index_add(1, groups.group, logq[:, 1:].exp())
    own = groups.group_first[None, :] == nxt[keep][:, None]  # [rows, G]
    target = teacher[keep].float().exp() * own
    alone = (1.0 - target.sum(1)).clamp_min(0.0)
    picked = torch.where(own, mass, torch.ones_like(mass)).clamp_min(1e-30).log()
    return -(target * picked).sum() - (alone * logq[:, 0]).sum()
