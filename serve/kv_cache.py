"""Paged K/V tensors and the slot mapping that addresses them.

One tensor per K and V holds every layer: [layers, kv_heads, num_blocks * block_size, head_dim].
A token's slot is `block_table[pos // block_size] * block_size + pos % block_size`; the forward
writes new K/V with one `index_copy_` per layer. Heads come before slots so that gathering whole
blocks with `index_select` yields [kv_heads, batch, length, head_dim] ready for batched matmul:
on CPU that is 5x cheaper than per-slot fancy indexing followed by a transpose copy. Target and draft
caches share block ids (and so one block manager) but have their own tensors.
"""

from __future__ import annotations

import torch

from serve import device_io, hugepages


class KVCache:
    """Paged K/V storage for one model."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        if torch.device(device).type == "cpu":  # huge pages where the OS gives them (serve.hugepages)
            self.k, self.v = hugepages.zeros(shape, dtype), hugepages.zeros(shape, dtype)
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        # one view per layer, made once: indexing k[layer] on every layer of every step costs a
        # tensor construction each time (measurable in a decode step of a small model)
        self.layers = list(zip(self.k.unbind(0), self.v.unbind(0)))

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory one block costs for K and V over all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, kv_heads, head_dim] at `slots` [T] of `layer`."""
        slots = slots.to(self.k.device)
        self.k[layer].index_copy_(1, slots, k.transpose(0, 1))
        self.v[layer].index_copy_(1, slots, v.transpose(0, 1))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write)."""
        if not pairs:
            return
        bs, device = self.block_size, self.k.device
        src = device_io.tensor([s * bs + o for s, _ in pairs for o in range(bs)], torch.long, device)
        dst = device_io.tensor([d * bs + o for _, d in pairs for o in range(bs)], torch.long, device)
        self.k[:, :, dst] = self.k[:, :, src]
        self.v[:, :, dst] = self.v[:, :, src]


def block_table_tensor(tables: list[list[int]]) -> torch.Tensor:
    """Pad block tables to one int64 tensor [num_seqs, max_blocks] (padding points at block 0).

    Padding and handed-back entries (`NULL_BLOCK`, outside a sliding window) also point at block
    0 and are never read unmasked: attention masks key positions past each context length and
    before each window.
    """
    width = max((len(t) for t in tables), default=0) or 1
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long).clamp_(min=0)


def slots_for(block_tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot of each (sequence row, position) pair, vectorised (no per-token Python)."""
    return block_tables[rows, positions // block_size] * block_size + positions % block_size
