"""The attention backend interface and its selection by device.

The model calls `backend.build_metadata` once per forward (all index arithmetic, shared by
every layer) and `backend.forward` once per layer. The CUDA backend (Triton kernels,
`triton_backend.py`) implements the same methods; `get_backend` picks by device so the model
never branches on it.
"""

from __future__ import annotations

import os
import warnings
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


BACKENDS = ("torch", "triton")


def get_backend(device: torch.device | str, prefer: str | None = None, **options: int) -> AttentionBackend:
    """The attention backend for `device`: Triton kernels on CUDA, the torch reference on CPU.

    `prefer="torch"` or `prefer="triton"` overrides the choice. Triton on CPU only runs under
    Triton's interpreter (TRITON_INTERPRET=1, tests); it raises a ValueError otherwise. The
    Triton module is imported here, lazily, so CPU serving never imports triton. On CUDA without
    triton installed the automatic choice falls back to torch with a warning. `options`
    (partition_size, block_m) go to the Triton backend.
    """
    from serve.attention.torch_ref import TorchPagedAttention

    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device {kind!r} is not supported by serve; supported: cpu, cuda")
    if prefer not in (None, *BACKENDS):
        raise ValueError(f"prefer={prefer!r} is not a backend; use one of {BACKENDS} or None (by device)")
    choice = prefer or ("triton" if kind == "cuda" else "torch")
    if choice == "torch":
        if options:
            raise ValueError(f"options {sorted(options)} only apply to the triton backend, not torch")
        return TorchPagedAttention()
    if kind == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":  # before triton is imported
        raise ValueError("prefer='triton' on cpu needs TRITON_INTERPRET=1 set before triton is imported (tests only)")
    try:
        from serve.attention.triton_backend import TritonPagedAttention
    except ImportError as err:
        if prefer == "triton":
            raise ValueError(f"prefer='triton' but triton cannot be imported ({err}); install triton or use prefer='torch'") from err
        warnings.warn(f"triton cannot be imported ({err}); serving attention on {kind} with the torch backend", stacklevel=2)
        return TorchPagedAttention()
    return TritonPagedAttention(device, **options)
