"""What an attention backend is: the per-sequence chunk description and the protocol.

Kept apart from `backend.py` (which picks an implementation by device) so that the
implementations import this module and the selector imports them, with no circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class SeqChunk:
    """One sequence's share of a forward: `query_len` new tokens ending a `context_len` context.

    The queries occupy rows [query_start, query_start + query_len) of the flat token batch and
    sit at positions [context_len - query_len, context_len). With a sliding `window`, a query at
    position p sees keys at positions (p - window, p] only, and `block_table` may hold
    `NULL_BLOCK` where blocks no query can see were handed back. `group_tables` are the
    sequence's tables of further block groups (`serve.kv_layout`); the model picks one per layer.
    """

    query_start: int
    query_len: int
    context_len: int
    block_table: list[int]
    group_tables: tuple[list[int], ...] = ()
    window: int | None = None


class AttentionBackend(Protocol):
    """What the model needs from an attention implementation."""

    name: str

    def build_metadata(self, chunks: list[SeqChunk], block_size: int) -> object:
        """Precompute slots, gather indices and masks for one forward."""
        ...

    def slot_mapping(self, metadata: object) -> torch.Tensor:
        """Cache slot of every query token, [T] int64."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
        scale: float,
    ) -> torch.Tensor:
        """Attention output [T, heads, head_dim]; k_new/v_new are already written to the cache."""
        ...
