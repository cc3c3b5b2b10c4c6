"""The attention backend interface and its selection by device.

The model calls `backend.build_metadata` once per forward (all index arithmetic, shared by
every layer) and `backend.forward` once per layer. A backend for CUDA (Triton kernels, another
issue) implements the same two methods; `get_backend` picks by device so the model never
branches on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class SeqChunk:
    """One sequence's share of a forward: `query_len` new tokens ending a `context_len` context.

    The queries occupy rows [query_start, query_start + query_len) of the flat token batch and
    sit at positions [context_len - query_len, context_len).
    """

    query_start: int
    query_len: int
    context_len: int
    block_table: list[int]


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


def get_backend(device: torch.device | str) -> AttentionBackend:
    """The attention backend for `device`; CPU (and, until its kernels land, CUDA) use torch."""
    from serve.attention.torch_ref import TorchPagedAttention

    kind = torch.device(device).type
    if kind in ("cpu", "cuda"):
        return TorchPagedAttention()
    raise ValueError(f"device {kind!r} is not supported by serve; supported: cpu, cuda")
