"""Cross-tokenizer distillation: the base model, reading the base tokenization of a text, teaches
the extended model reading the extended tokenization of the same text.

Why: a new piece is a single token where the base read several, so the extended model cannot
copy the base's distributions token by token. Both tokenizers share the normaliser, though, so
a token's end offset says how much of the text a model has read. Where the extended model has
read exactly what the base has read (its token ends where a base token ends), the base's
next-token distribution says which base token comes next. The extended model writes that
either as the base token itself or as a new piece whose text starts with it (the first id of
the piece's base split). Summing the extended model's probabilities over a base token and the
new pieces that start with it gives its probability of the base's next token, and the loss is
the cross-entropy of that against the base's top-``k`` distribution (the aggregated teacher of
cross-tokenizer distillation, exact for the first base token of what follows). The ordinary
next-token loss on the extended tokens decides how that mass splits between a base token and
its longer pieces.

This is what fits new rows "so the model reading a new piece behaves as reading its subword
sequence" (issue 44): it scores a new piece both as input (what the model predicts after it)
and as output (how much probability it takes from the base token it starts with).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tokenizer_ext import chain_teacher
from warsha.lm_loss import ColumnGroups, hidden_and_head, linear_cross_entropy, linear_cross_entropy_rows, trained_rows


def first_pieces(sources: Sequence[Sequence[int]]) -> torch.Tensor:
    """For the i-th new id: the base id its text starts with (``-1`` when its base split is
    empty). ``sources`` is ``embed.base_splits``' output for the new ids, in id order."""
    return torch.tensor([ids[0] if ids else -1 for ids in sources] or [], dtype=torch.long)


def aligned_pairs(ext_ends: Sequence[int], base_ends: Sequence[int]) -> list[tuple[int, int]]:
    """``(i, j)``: extended position ``i`` and base position ``j`` end at the same character.

    Ends are each token's end offset in the text (the BOS at 0). Where several tokens end at one
    offset (a zero-width token), the last of them is taken: it has read the most.
    """
    ext_last = {end: i for i, end in enumerate(ext_ends)}
    base_last = {end: j for j, end in enumerate(base_ends)}
    return sorted((i, base_last[end]) for end, i in ext_last.items() if end in base_last)


@dataclass
class Window:
    """One training text under both tokenizers, BOS first, and the positions where they align."""

    ext_ids: list[int]
    base_ids: list[int]
    pairs: list[tuple[int, int]]


def _ids_and_ends(tok: Any, text: str) -> tuple[list[int], list[int]]:
    """BOS then ``text``'s ids, with each token's end offset (the BOS ends at 0)."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    return bos + list(enc["input_ids"]), [0] * len(bos) + [end for _, end in enc["offset_mapping"]]


def window(text: str, ext_tok: Any, base_tok: Any, seq_len: int) -> Window:
    """The longest prefix of ``text`` that fits ``seq_len`` extended tokens (BOS included), cut at
    an extended token's end, tokenized by both tokenizers."""
    ids, ends = _ids_and_ends(ext_tok, text)
    cut = text[: ends[min(seq_len, len(ends)) - 1]]
    ext_ids, ext_ends = _ids_and_ends(ext_tok, cut)
    base_ids, base_ends = _ids_and_ends(base_tok, cut)
    ext_ids, ext_ends = ext_ids[:seq_len], ext_ends[:seq_len]  # re-encoding a prefix may merge differently
    return Window(ext_ids, base_ids, aligned_pairs(ext_ends, base_ends))


CHARS_PER_TOKEN = 8  # more text than any tokenizer here needs for a token: windows come out full


def sample_windows(
    texts: Sequence[str], n: int, ext_tok: Any, base_tok: Any, seq_len: int, seed: int | str
) -> list[Window]:
    """``n`` windows, each random documents joined by newlines until it holds ``seq_len``
    extended tokens (documents are shorter than a window: one alone would leave most of it
    padding), a pure function of ``seed`` (a resumed run sees the same batches)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        docs: list[str] = []
        while sum(map(len, docs)) < seq_len * CHARS_PER_TOKEN and len(docs) < len(texts):
            docs.append(texts[rng.randrange(len(texts))])
        out.append(window("\n".join(docs), ext_tok, base_tok, seq_len))
    return out


def collate(windows: Sequence[Window], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors: ``input_ids``/``labels`` (-100 on padding), ``base_ids`` and
    ``base_mask``, and ``pairs`` [B, P, 2] padded with -1."""
    b = len(windows)
    length = max(len(w.ext_ids) for w in windows)
    base_len = max(len(w.base_ids) for w in windows)
    n_pairs = max(1, max(len(w.pairs) for w in windows))
    ids = torch.full((b, length), pad_id, dtype=torch.long)
    labels = torch.full((b, length), -100, dtype=torch.long)
    base = torch.full((b, base_len), pad_id, dtype=torch.long)
    mask = torch.zeros((b, base_len), dtype=torch.long)
    pairs = torch.full((b, n_pairs, 2), -1, dtype=torch.long)
    for r, w in enumerate(windows):
        ids[r, : len(w.ext_ids)] = torch.tensor(w.ext_ids)
        labels[r, : len(w.ext_ids)] = torch.tensor(w.ext_ids)
        base[r, : len(w.base_ids)] = torch.tensor(w.base_ids)
        mask[r, : len(w.base_ids)] = 1
        if w.pairs:
            pairs[r, : len(w.pairs)] = torch.tensor(w.pairs)
    return {"input_ids": ids, "labels": labels, "base_ids": base, "base_mask": mask, "pairs": pairs}


def aggregated_ce(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    firsts: torch.Tensor,
    first_new: int,
    teacher_ids: torch.Tensor,
    teacher_probs: torch.Tensor,
) -> torch.Tensor:
    """Mean over rows of ``-sum_k p_k log q'(b_k)``, where ``q`` is ``softmax(hidden @ weight.T)``
    over the extended vocabulary and ``q'(b) = q(b) + sum of q(v) over new ids v whose first base
    id is b`` (``firsts[v - first_new]``). Rows of ``weight`` past the new ids (padding) take
    probability but belong to no base id.

    The fused head loss with grouped targets (``warsha.lm_loss.ColumnGroups``): chunks of rows,
    both gradients formed in the forward, so the backward never runs the 278k-row head again;
    a head ``mark_trained_rows`` marked gets the gradient of its trained rows only."""
    groups = ColumnGroups(first_new, *_new_columns(firsts, first_new, hidden.device))
    ones = torch.ones(hidden.shape[0], device=hidden.device)
    marked = trained_rows(weight)
    if marked is None:
        return linear_cross_entropy(hidden, weight, teacher_ids, ones, teacher_probs, groups)
    return linear_cross_entropy_rows(hidden, weight, *marked, teacher_ids, ones, teacher_probs, groups)


def _new_columns(firsts: torch.Tensor, first_new: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(the new ids that start with a base id, those base ids), on ``device``."""
    keep = torch.nonzero(firsts >= 0).squeeze(1)
    return (keep + first_new).to(device), firsts[keep].to(device)


def logits_ce(
    logits: torch.Tensor,
    new_cols: torch.Tensor,
    new_firsts: torch.Tensor,
    first_new: int,
    teacher_ids: torch.Tensor,
    teacher_probs: torch.Tensor,
) -> torch.Tensor:
    """Summed ``-sum_k p_k log q'(b_k)`` over the rows of ``logits`` [rows, vocab] (``aggregated_ce``)."""
    probs = torch.softmax(logits.float(), -1)
    grouped = probs[:, :first_new].index_add(1, new_firsts, probs.index_select(1, new_cols))
    picked = grouped.gather(1, teacher_ids).clamp_min(1e-30)
    return -(picked.log() * teacher_probs.float()).sum()


def teacher_forward(teacher: Any, batch: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
    """The base's ``hidden_and_head`` on the batch's base ids, without gradients."""
    with torch.no_grad():
        return hidden_and_head(teacher, batch["base_ids"], batch["base_mask"])


def aligned(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch row, extended position, base position) of every aligned pair, padding pairs
    dropped, in the order of ``pairs``."""
    pairs = batch["pairs"]
    rows, cols = torch.nonzero(pairs[..., 0] >= 0, as_tuple=True)
    return rows, pairs[rows, cols, 0], pairs[rows, cols, 1]


def teacher_top(
    forward: tuple[Any, torch.Tensor], batch: dict[str, torch.Tensor], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The base's top-``k`` next-token ids and renormalised probabilities at every aligned pair's
    base position (``aligned``'s order), from its ``teacher_forward``."""
    head, out = forward
    rows, _, base_pos = aligned(batch)
    with torch.no_grad():
        picked = out[rows, base_pos]
        logits = picked if head is None else torch.mm(picked, head.t())
        values, ids = torch.topk(logits.float(), k, -1)
    return ids, torch.softmax(values, -1)


def chain_term(
    forward: tuple[Any, torch.Tensor],
    batch: dict[str, torch.Tensor],
    at: torch.Tensor,
    weight: torch.Tensor | None,
    groups: chain_teacher.ChainGroups,
) -> torch.Tensor:
    """``chain_teacher.chain_ce`` at the aligned pairs whose base text goes on for a token (its
    next base id, and the base's distribution one position later), averaged over those pairs;
    ``at`` [pairs, d] is the extended model's final hidden state (or logits, ``weight`` None)."""
    head, out = forward
    rows, _, base_pos = aligned(batch)
    nxt_pos = base_pos + 1
    ok = nxt_pos < batch["base_ids"].shape[1]
    ok[ok.clone()] = batch["base_mask"][rows[ok], nxt_pos[ok]] > 0
    if not bool(ok.any()):
        return at.sum() * 0.0
    rows, nxt_pos, at = rows[ok], nxt_pos[ok], at[ok]
    nxt = batch["base_ids"][rows, nxt_pos]
    groups = chain_teacher.to(groups, at.device)
    teacher = chain_teacher.second_logprobs(out[rows, nxt_pos], head, groups.group_second)
    n, lo = len(groups.firsts), groups.first_new
    if weight is None:
        new_logits, nxt_logits = at[:, lo : lo + n], at.gather(1, nxt[:, None])[:, 0]
    else:
        new_logits = at @ weight[lo : lo + n].t()
        nxt_logits = (at * weight[nxt]).sum(-1)
    return chain_teacher.chain_ce(new_logits, nxt_logits, nxt, groups, teacher) / len(nxt)


def loss_fn(
    teacher: Any,
    firsts: torch.Tensor,
    first_new: int,
    k: int,
    distill_weight: float,
    nll_weight: float = 1.0,
    chain: tuple[chain_teacher.ChainGroups, float] | None = None,
) -> Callable[[Any, dict[str, torch.Tensor]], torch.Tensor]:
    """The training loss: ``nll_weight`` times the next-token loss on the extended tokens plus
    ``distill_weight`` times the aggregated cross-entropy against ``teacher`` at the aligned
    positions, plus, with ``chain`` (groups, weight), that weight times the chain teacher's second
    level there (``chain_term``); each term skipped at weight 0."""
    from warsha.lm_loss import IGNORE_INDEX

    teacher.eval()
    for q in teacher.parameters():
        q.requires_grad_(False)
    chain_weight = chain[1] if chain else 0.0

    def fn(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        weight, out = hidden_and_head(model, batch["input_ids"])
        loss = out.new_zeros((), dtype=torch.float32)
        if nll_weight:
            targets = batch["labels"][:, 1:]
            keep = targets != IGNORE_INDEX
            if weight is None:  # logits already: the family transforms them after the head
                nll = torch.nn.functional.cross_entropy(out[:, :-1][keep].float(), targets[keep])
            else:
                h, ones = out[:, :-1][keep], torch.ones(int(keep.sum()), device=out.device)
                marked = trained_rows(weight)
                nll = (
                    linear_cross_entropy(h, weight, targets[keep], ones)
                    if marked is None
                    else linear_cross_entropy_rows(h, weight, *marked, targets[keep], ones)
                )
            loss = loss + nll_weight * nll
        if distill_weight or chain_weight:
            forward = teacher_forward(teacher, batch)
            rows, ext_pos, _ = aligned(batch)
            at = out[rows, ext_pos]
            if distill_weight:
                t_ids, t_probs = teacher_top(forward, batch, k)
                if weight is None:
                    cols_new = _new_columns(firsts, first_new, at.device)
                    distill = logits_ce(at, *cols_new, first_new, t_ids, t_probs) / max(len(at), 1)
                else:
                    distill = aggregated_ce(at, weight, firsts, first_new, t_ids, t_probs)
                loss = loss + distill_weight * distill
            if chain_weight:
                assert chain is not None
                loss = loss + chain_weight * chain_term(forward, batch, at, weight, chain[0])
        return loss

    return fn
