"""`TritonPagedAttention`: the attention backend for CUDA, built from serve's Triton kernels.

Kernel design (details in each module's docstring and in serve/KERNELS.md):
- decode (`triton_decode`): sequences whose chunk is a single query token. Flash-decoding: grid
  (sequence, KV head, partition of the context); each program runs an online softmax over its
  partition for the whole GQA group of query heads and, when a sequence spans several
  partitions, leaves a partial output plus its log-sum-exp; a second kernel merges them.
- prefill (`triton_prefill`): every other sequence (prompt chunks, chunked prefill, speculative
  verification). Grid (query tile, KV head) over a host-made list of tiles (varlen without
  padding programs); keys of the cached context first, then the chunk's own keys causally.
- cache write (`triton_cache`): K/V rows to their slots, slot < 0 skipped.
All scores, softmax statistics and accumulators are float32: bf16 has 8 bits of mantissa, and a
sum of thousands of exponentials or a running max rescaled hundreds of times in bf16 drifts
visibly; operands are upcast to float32 before `tl.dot` (on bf16 the interpreter's dot is wrong,
and tf32 dots on upcast bf16 values lose nothing).

Selection: `serve.attention.get_backend(device)` returns this backend for CUDA devices and the
torch reference for CPU; `get_backend(device, prefer="triton"|"torch")` forces one. On CPU the
Triton backend only runs under Triton's interpreter (TRITON_INTERPRET=1, set before triton is
first imported), which is how the tests check it against `TorchPagedAttention`. This module is
imported only when the Triton backend is chosen, so `import serve` never imports triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve.attention import triton_cache, triton_decode, triton_prefill
from serve.attention import triton_common as common
from serve.attention.interface import SeqChunk
from serve.attention.torch_ref import _check_layout
from serve.device_io import to_device
from serve.kv_cache import block_table_tensor, slots_for


@dataclass
class DecodePlan:
    """Sequences with one query token: their query row, block table and context length."""

    q_rows: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32
    max_context_len: int


@dataclass
class PrefillPlan:
    """Sequences with longer chunks and the list of their BLOCK_M-token query tiles."""

    block_tables: torch.Tensor  # [B, max_blocks] int32
    q_starts: torch.Tensor  # [B] int32
    q_lens: torch.Tensor  # [B] int32
    context_lens: torch.Tensor  # [B] int32
    tile_seq: torch.Tensor  # [tiles] int32, index into the rows above
    tile_start: torch.Tensor  # [tiles] int32, first query index of the tile within its chunk


@dataclass
class TritonAttentionMetadata:
    """Per-forward plan shared by all layers; every tensor is already on the device."""

    slot_mapping: torch.Tensor  # [T] int64
    num_tokens: int
    block_size: int
    decode: DecodePlan | None
    prefill: PrefillPlan | None
    window: int = 0  # sliding window of every chunk (0: full attention)


def _int32(values: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    """A host list as an int32 device tensor (the kernels index with int32 plus int64 offsets)."""
    return to_device(torch.tensor(values, dtype=torch.int32), device)


class TritonPagedAttention:
    """Paged attention through Triton kernels (CUDA; CPU only under TRITON_INTERPRET=1)."""

    name = "triton"

    def __init__(self, device: torch.device | str = "cuda", partition_size: int = 512, block_m: int = 16) -> None:
        self.device = torch.device(device)
        if self.device.type == "cpu" and not common.interpreting():
            raise ValueError(
                "TritonPagedAttention on cpu needs TRITON_INTERPRET=1 set before triton is imported "
                "(tests only); use get_backend('cpu') for the torch backend"
            )
        if partition_size <= 0 or partition_size % 16:
            raise ValueError(f"partition_size must be a positive multiple of 16, got {partition_size}")
        if block_m <= 0 or block_m & (block_m - 1) or block_m < 16:
            raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
        self.partition_size, self.block_m = partition_size, block_m

    def build_metadata(self, chunks: list[SeqChunk], block_size: int) -> TritonAttentionMetadata:
        """Slot mapping plus a decode plan (query length 1) and a prefill plan (the rest)."""
        _check_layout(chunks)
        windows = {c.window for c in chunks}
        if len(windows) > 1:
            raise ValueError(f"attention metadata: one forward's chunks must share a window, got {windows}")
        tables = block_table_tensor([c.block_table for c in chunks])
        seq_of_token = [i for i, c in enumerate(chunks) for _ in range(c.query_len)]
        positions = [p for c in chunks for p in range(c.context_len - c.query_len, c.context_len)]
        slots = slots_for(tables, torch.tensor(seq_of_token), torch.tensor(positions), block_size)
        decode = [i for i, c in enumerate(chunks) if c.query_len == 1]
        prefill = [i for i, c in enumerate(chunks) if c.query_len > 1]
        return TritonAttentionMetadata(
            slot_mapping=to_device(slots, self.device),
            num_tokens=len(positions),
            block_size=block_size,
            decode=self._decode_plan([chunks[i] for i in decode], tables[decode]) if decode else None,
            prefill=self._prefill_plan([chunks[i] for i in prefill], tables[prefill]) if prefill else None,
            window=next(iter(windows)) or 0,
        )

    def _decode_plan(self, chunks: list[SeqChunk], tables: torch.Tensor) -> DecodePlan:
        """Index tensors of the single-token sequences."""
        return DecodePlan(
            q_rows=_int32([c.query_start for c in chunks], self.device),
            block_tables=to_device(tables.to(torch.int32), self.device),
            context_lens=_int32([c.context_len for c in chunks], self.device),
            max_context_len=max(c.context_len for c in chunks),
        )

    def _prefill_plan(self, chunks: list[SeqChunk], tables: torch.Tensor) -> PrefillPlan:
        """Index tensors of the multi-token chunks and their query tiles."""
        tiles = [(i, m0) for i, c in enumerate(chunks) for m0 in range(0, c.query_len, self.block_m)]
        return PrefillPlan(
            block_tables=to_device(tables.to(torch.int32), self.device),
            q_starts=_int32([c.query_start for c in chunks], self.device),
            q_lens=_int32([c.query_len for c in chunks], self.device),
            context_lens=_int32([c.context_len for c in chunks], self.device),
            tile_seq=_int32([t[0] for t in tiles], self.device),
            tile_start=_int32([t[1] for t in tiles], self.device),
        )

    def slot_mapping(self, metadata: TritonAttentionMetadata) -> torch.Tensor:
        """Cache slot of every new token."""
        return metadata.slot_mapping

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store the new k, v [T, Hkv, D] into one layer's caches [Hkv, slots, D] by the slot mapping."""
        triton_cache.write_kv(k_cache, v_cache, metadata.slot_mapping, k, v)

    def forward(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T, H, D] against one layer's paged cache [Hkv, slots, D]; returns [T, H, D]."""
        self._check(q, k_new, v_new, k_cache, v_cache, metadata)
        q, k_new, v_new = (common.last_dim_contiguous(x) for x in (q, k_new, v_new))
        out = common.alloc(tuple(q.shape), q.dtype, q.device)
        d, p = metadata.decode, metadata.prefill
        if d is not None:
            triton_decode.paged_decode(
                q,
                k_cache,
                v_cache,
                out,
                d.q_rows,
                d.block_tables,
                d.context_lens,
                d.max_context_len,
                metadata.block_size,
                scale,
                self.partition_size,
                metadata.window,
            )
        if p is not None:
            triton_prefill.paged_prefill(
                q,
                k_new,
                v_new,
                k_cache,
                v_cache,
                out,
                p.block_tables,
                p.tile_seq,
                p.tile_start,
                p.q_starts,
                p.q_lens,
                p.context_lens,
                metadata.block_size,
                self.block_m,
                scale,
                metadata.window,
            )
        return out

    @staticmethod
    def _check(
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: TritonAttentionMetadata,
    ) -> None:
        """Shapes and devices agree with each other and with the metadata (cheap host checks)."""
        common.check_device("TritonPagedAttention.forward", q, k_new, v_new, k_cache, v_cache, md.slot_mapping)
        tokens, heads, dim = q.shape
        kv_heads = k_cache.shape[0]
        if tokens != md.num_tokens:
            raise ValueError(f"q has {tokens} tokens but the metadata was built for {md.num_tokens}")
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
        if k_cache.shape != v_cache.shape or k_cache.shape[2] != dim or k_cache.stride(-1) != 1:
            raise ValueError(
                f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} must be contiguous [Hkv, slots, {dim}]"
            )
        if k_new.shape != (tokens, kv_heads, dim) or v_new.shape != k_new.shape:
            raise ValueError(
                f"k_new/v_new must be [{tokens}, {kv_heads}, {dim}], got {tuple(k_new.shape)}/{tuple(v_new.shape)}"
            )
