"""One linear map from a new piece's subword rows to its row, shared by every new piece
(``tokenizer_ext.embed``'s ``fit_map``).

Why a map and not the rows: fitted row by row, a new piece learns only where it occurs, and
the fit's few thousand windows show most of 8,000 pieces a handful of times; the pieces a
text from another domain uses are the rarely seen ones, and they stay near their initialiser
(docs/adaptation.md: the per-row fit levelled off at MSA +25% at step 0). A map fitted on
every occurrence of every piece learns how the model composes a row from its parts and
applies it to all pieces at once (a linear form of the hypernetworks of zero-shot tokenizer
transfer, Minixhofer et al. 2024), with about a quarter of the parameters.

Each piece is described by three rows of the base: the mean of its split's rows, its first
and its last subword's row, and a constant. The map starts as the subword mean times
``scale`` (exactly what ``embed.initialise`` writes), so its fit starts where the rows fit
starts. With ``embed``'s ``fit_map_reads`` a piece is also described by what the base makes of
it: its hidden states after reading the piece's split (``read_features``), a block of the map
that starts at zero.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

PARTS = ("mean", "first", "last")


def features(base: torch.Tensor, sources: Sequence[Sequence[int]]) -> torch.Tensor:
    """``[n, 3 d + 1]`` float32: each piece's mean, first and last base row, then 1 (a piece
    with an empty split reads the mean of all base rows for each part)."""
    base = base.float()
    fallback = base.mean(0)
    rows = []
    for ids in sources:
        parts = (base[list(ids)].mean(0), base[ids[0]], base[ids[-1]]) if ids else (fallback,) * 3
        rows.append(torch.cat([*parts, base.new_ones(1)]))
    return torch.stack(rows) if rows else base.new_zeros(0, 3 * base.shape[1] + 1)


def mean_map(dim: int, scale: float, extra: int = 0) -> torch.Tensor:
    """``[3 d + 1 + extra, d]``: the map that returns ``scale`` times the subword mean (the
    ``extra`` rows, for ``read_features``, start at zero)."""
    w = torch.zeros(3 * dim + 1 + extra, dim)
    w[:dim] = torch.eye(dim) * scale
    return w


@torch.no_grad()
def read_features(
    base_model: Any,
    bos: int | None,
    sources: Sequence[Sequence[int]],
    layers: Sequence[int],
    norm: float,
    batch: int = 512,
) -> torch.Tensor:
    """``[n, len(layers) d]``: the base's hidden states after reading ``[BOS] + split`` of each
    piece, at its last subword, for each of ``layers`` (indices into ``output_hidden_states``: 0
    the embeddings, -1 the final normed state); each block scaled to mean row norm ``norm``.

    Why: the subword rows say what a piece is made of, not what the base makes of it; its
    hidden states after reading the split are that reading, the input of the hypernetworks of
    zero-shot tokenizer transfer (Minixhofer et al. 2024), here for a linear map. A piece with an
    empty split reads zeros. Pieces are batched by length with right padding."""
    d = base_model.get_input_embeddings().weight.shape[1]
    out = torch.zeros(len(sources), len(layers), d)
    start = [] if bos is None else [bos]
    order = sorted((i for i, ids in enumerate(sources) if ids), key=lambda i: len(sources[i]))
    for lo in range(0, len(order), batch):
        idx = order[lo : lo + batch]
        width = len(start) + len(sources[idx[-1]])
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            ids[r, : len(start) + len(sources[i])] = torch.tensor([*start, *sources[i]])
            mask[r, : len(start) + len(sources[i])] = 1
        states = base_model.get_decoder()(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        last = mask.sum(1) - 1
        for k, layer in enumerate(layers):
            out[torch.tensor(idx), k] = states[layer][torch.arange(len(idx)), last].float()
    scale = norm / out.norm(dim=2).sum(0).clamp_min(1e-12) * max(len(order), 1)  # [layers]
    return (out * scale[None, :, None]).reshape(len(sources), len(layers) * d)


class RowMap(torch.nn.Module):
    """The new rows ``[first, first + n)`` of each matrix as ``features @ map`` (with ``reads``,
    ``read_features`` appended to every matrix's features).

    One map per matrix (an untied head gets its own); every other row stays the matrix's own,
    frozen. Registered on the model during the fit, so its checkpoints carry the maps and the
    features move with it to the training device.
    """

    def __init__(
        self,
        matrices: Sequence[torch.nn.Parameter],
        first: int,
        sources: Sequence[Sequence[int]],
        scale: float,
        reads: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.first, self.n = first, len(sources)
        self.maps = torch.nn.ParameterList()
        for i, w in enumerate(matrices):
            if hasattr(w, "ds_id"):
                raise ValueError(
                    "tokenizer_ext.embed: fit_map needs whole matrices, not ZeRO-3 partitions; run embed"
                    " without a DeepSpeed ZeRO-3 config (the fit trains a small map, it needs no sharding)"
                )
            feats = features(w.detach()[:first], sources)
            extra = 0 if reads is None else reads.shape[1]
            if reads is not None:
                feats = torch.cat([feats, reads.to(feats)], 1)
            self.register_buffer(f"features_{i}", feats, persistent=False)
            self.maps.append(torch.nn.Parameter(mean_map(w.shape[1], scale, extra).to(w.device)))

    def rows(self, i: int) -> torch.Tensor:
        """The new rows of matrix ``i`` under the current map."""
        return getattr(self, f"features_{i}") @ self.maps[i]

    def full(self, i: int, weight: torch.Tensor) -> torch.Tensor:
        """Matrix ``i`` with its new rows from the map (differentiable in the map only), marked
        with those rows so a fused loss forms the head's gradient for them alone
        (``warsha.lm_loss.mark_trained_rows``)."""
        from warsha.lm_loss import mark_trained_rows

        w = weight.detach()
        rows = self.rows(i).to(w.dtype)
        full = torch.cat([w[: self.first], rows, w[self.first + self.n :]])
        ids = torch.arange(self.first, self.first + self.n, device=w.device)
        return mark_trained_rows(full, ids, rows)

    def write(self, matrices: Sequence[torch.nn.Parameter]) -> None:
        """Copy the mapped rows into the matrices (after the fit)."""
        with torch.no_grad():
            for i, w in enumerate(matrices):
                w[self.first : self.first + self.n] = self.rows(i).to(w.dtype)


@contextlib.contextmanager
def mapped(model: Any, row_map: RowMap, matrices: Sequence[torch.nn.Parameter]) -> Iterator[None]:
    """Inside the block, the model's embedding and head multiply by the mapped ``matrices``
    (``fit_rows.trained_matrices``' order: the embedding, then an untied head).

    The modules' ``weight`` parameters are swapped for plain tensors and put back on exit; a
    tied head gets its embedding's tensor, as it shared its parameter. The autograd graph
    built inside keeps the mapped tensors, so ``backward`` after the block reaches the maps.
    """
    swap = {id(w): row_map.full(i, w) for i, w in enumerate(matrices)}
    modules = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
    saved = [(m, m._parameters["weight"]) for m in modules]
    try:
        for m, w in saved:
            del m._parameters["weight"]
            m.__dict__["weight"] = swap[id(w)]
        yield
    finally:
        for m, w in saved:
            m.__dict__.pop("weight", None)
            m._parameters["weight"] = w
