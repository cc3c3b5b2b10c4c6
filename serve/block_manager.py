"""Paged KV block allocation: free list, reference counts, prefix caching, copy-on-write.

No torch here: the block manager only hands out integer block ids. The KV tensors live in
`kv_cache.py` and are indexed by `block_id * block_size + offset` (the "slot").

Why each mechanism exists:
- fixed-size blocks keep the waste per sequence below one block (PagedAttention's < 4%),
  instead of reserving max-length contiguous memory per request;
- reference counts let many sequences share one physical block (prefix hits, forks);
- prefix caching keys every *full* block by a hash chained over all tokens before it, so a
  block is reused only when the whole prefix matches. The key is sha256(parent key, token
  ids), not Python's `hash()`: a 64-bit non-cryptographic hash lets a client craft a prompt
  whose blocks collide with another user's cached prefix (vLLM's CVE-2025-25183), and the
  token-id comparison on a hit stays as a second guard. Freed cached blocks stay hashed in the
  free list and are evicted least-recently-freed first; tails are freed first because a
  prefix's later blocks are less likely to be shared than its head;
- copy-on-write: a sequence about to write into a block another sequence still holds gets a
  private copy first (the engine performs the queued copies before the forward).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from serve.sequence import Sequence


@dataclass
class Block:
    """One physical block; `token_ids` is kept for hashed blocks to rule out hash collisions."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None


def chain_hash(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """sha256 key of a full block given the key of the block before it (None for the first)."""
    h = hashlib.sha256(parent if parent is not None else b"warsha-prefix-root")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


class BlockManager:
    """Owns `num_blocks` blocks of `block_size` token slots each."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}; give the KV cache more memory")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.pending_copies: list[tuple[int, int]] = []

    # ----------------------------------------------------------------- accounting
    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any sequence (hashed ones among them can still be hit)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Number of blocks that hold `num_tokens` slots."""
        return -(-num_tokens // self.block_size)

    # ----------------------------------------------------------------- prefix cache
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids whose chained hashes match `seq`'s leading full blocks.

        At least one token is always left to compute, because the forward over it produces the
        logits for the next token.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent: bytes | None = None
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = chain_hash(parent, tokens)
            block_id = self._cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, seq: Sequence, num_ready_tokens: int) -> None:
        """Register the full blocks among the first `num_ready_tokens` tokens for reuse.

        `num_ready_tokens` must count only committed tokens whose K/V is written in every cache
        sharing the block table (target and draft), or a later hit would read garbage.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), min(num_ready_tokens // bs, len(seq.block_table))):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = chain_hash(parent, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and h not in self._cached:
                block.block_hash, block.token_ids = h, tokens
                self._cached[h] = block.block_id

    # ----------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached_blocks: list[int] | None = None,
        num_lookahead: int = 0,
    ) -> bool:
        """Make `seq`'s block table cover its computed tokens plus `num_new_tokens` + lookahead.

        Returns False, changing nothing, when the pool is too small; the scheduler then
        preempts. `cached_blocks` (prefix hits) are only accepted for a sequence that holds no
        blocks yet.
        """
        cached = cached_blocks or []
        if cached and seq.block_table:
            raise ValueError(f"request {seq.request_id}: cached blocks given to a sequence that already holds blocks")
        start = len(cached) * self.block_size if cached else seq.num_computed_tokens
        table_len = len(cached) if cached else len(seq.block_table)
        total_blocks = self.blocks_needed(start + num_new_tokens + num_lookahead)
        new_blocks = max(0, total_blocks - table_len)
        cow = [] if cached else self._shared_blocks_from(seq, start // self.block_size)
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        if new_blocks + len(cow) > self.num_free_blocks - revived:
            return False
        for b in cached:
            self._take(b)
        seq.block_table.extend(cached)
        for index in cow:
            self._copy_on_write(seq, index)
        for _ in range(new_blocks):
            seq.block_table.append(self._pop_free())
        return True

    def _shared_blocks_from(self, seq: Sequence, first_index: int) -> list[int]:
        """Indices in `seq.block_table` at or after `first_index` that other sequences share."""
        return [i for i in range(first_index, len(seq.block_table)) if self.blocks[seq.block_table[i]].ref_count > 1]

    def _copy_on_write(self, seq: Sequence, index: int) -> None:
        """Give `seq` a private copy of the shared block at `index` and queue the data copy."""
        src = seq.block_table[index]
        dst = self._pop_free()
        self.blocks[src].ref_count -= 1
        seq.block_table[index] = dst
        del seq.block_hashes[index:]
        self.pending_copies.append((src, dst))

    def _take(self, block_id: int) -> None:
        """Add a reference to an existing (possibly free but still hashed) block."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        """Take the least recently freed block, evicting its cached hash if it had one."""
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash, block.token_ids = None, None
        block.ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        """Drop one reference; a block nobody holds goes to the back of the free list."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} released more often than taken (engine bug)")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None

    # ----------------------------------------------------------------- release
    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks (on finish, abort or preemption), tail first."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free blocks past the first `num_tokens` slots (speculative rollback)."""
        keep = self.blocks_needed(num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]
        del seq.block_hashes[num_tokens // self.block_size :]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share all of `parent`'s blocks; writes later trigger copy-on-write."""
        if child.block_table:
            raise ValueError(f"request {child.request_id}: cannot fork into a sequence that holds blocks")
        for block_id in parent.block_table:
            self._take(block_id)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.draft_num_computed_tokens = parent.draft_num_computed_tokens

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Return and clear the (src, dst) block copies the KV cache must perform."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def check_no_leaks(self) -> None:
        """Raise if any block is still referenced; tests call it after every workload."""
        held = [b.block_id for b in self.blocks if b.ref_count != 0]
        if held or len(self._free) != self.num_blocks:
            raise RuntimeError(f"KV block leak: blocks still referenced: {held[:10]}")
