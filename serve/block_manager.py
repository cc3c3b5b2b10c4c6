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
  private copy first (the engine performs the queued copies before the forward);
- block groups (`serve.kv_layout`, vLLM's hybrid allocator): a model with sliding-window layers
  gives each sequence one table per group. Full groups keep every block; a sliding group hands
  back (to the shared pool, marking the entry `NULL_BLOCK`) each block that lies wholly before
  the window of the earliest query still to come, so a long sequence holds about window /
  block_size blocks per sliding group. Prefix hits must then hold in every group: all leading
  blocks for full groups, the blocks under the window before the hit for sliding ones.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from serve.sequence import Sequence

NULL_BLOCK = -1  # a table entry whose block was handed back (outside every query's window)


@dataclass
class Block:
    """One physical block; `token_ids` is kept for hashed blocks to rule out hash collisions."""

    block_id: int
    ref_count: int = 0
    block_hash: Hashable | None = None  # the key in the prefix cache: the chain hash, with the group if > 0
    token_ids: tuple[int, ...] | None = None


def chain_hash(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """sha256 key of a full block given the key of the block before it (None for the first)."""
    h = hashlib.sha256(parent if parent is not None else b"warsha-prefix-root")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


class CachedPrefix(list):
    """Prefix hits of group 0 (a list of block ids, as the scheduler counts them) plus every
    group's hits in `group_hits` (sliding groups: `NULL_BLOCK` before the window)."""

    group_hits: list[list[int]]


def blocks_to_hold(
    group_windows: tuple[int | None, ...], block_size: int, num_tokens: int, max_chunk: int | None = None
) -> int:
    """Most blocks one sequence of `num_tokens` holds at once over all groups.

    A sliding group holds its window plus the chunk being computed (`max_chunk`, the token budget
    of a step); without a chunk bound it is counted as full.
    """
    full = -(-num_tokens // block_size)
    total = 0
    for w in group_windows:
        if w is None or max_chunk is None:
            total += full
        else:
            total += min(full, -(-(w + max_chunk) // block_size) + 1)
    return total


class BlockManager:
    """Owns `num_blocks` blocks of `block_size` token slots each."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        group_windows: tuple[int | None, ...] = (None,),
        max_chunk_tokens: int | None = None,
        track_draft: bool = False,
    ) -> None:
        """`group_windows`: one entry per block group (None: full attention). `max_chunk_tokens`:
        the step token budget (bounds what a sliding group holds). `track_draft`: a draft model
        shares the tables and may lag behind, so windows are measured from its position too."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}; give the KV cache more memory")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        if not group_windows or any(w is not None and w < 1 for w in group_windows):
            raise ValueError(f"group_windows must be non-empty with windows >= 1, got {group_windows}")
        self.group_windows = tuple(group_windows)
        self.max_chunk_tokens = max_chunk_tokens
        self.track_draft = track_draft
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[Hashable, int] = {}
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

    def blocks_to_hold(self, num_tokens: int) -> int:
        """Most blocks a sequence of `num_tokens` holds at once over all groups (admission)."""
        return blocks_to_hold(self.group_windows, self.block_size, num_tokens, self.max_chunk_tokens)

    def tables(self, seq: Sequence) -> list[list[int]]:
        """`seq`'s block table of every group (group 0 is `seq.block_table`)."""
        while len(seq.group_tables) < len(self.group_windows) - 1:
            seq.group_tables.append([])
        return [seq.block_table, *seq.group_tables]

    def _key(self, group: int, block_hash: int) -> Hashable:
        """Prefix-cache key: group 0 keeps the bare chain hash (single-group models unchanged)."""
        return block_hash if group == 0 else (group, block_hash)

    def _hit(self, group: int, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        """The cached block of `group` for this chain hash, if its tokens match."""
        block_id = self._cached.get(self._key(group, block_hash))
        if block_id is None or self.blocks[block_id].token_ids != tokens:
            return None
        return block_id

    def _window_start(self, window: int, position: int) -> int:
        """First block index a query at `position` (or later) can read through `window`."""
        return max(0, position - window + 1) // self.block_size

    # ----------------------------------------------------------------- prefix cache
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids whose chained hashes match `seq`'s leading full blocks (group 0's; all
        groups' hits ride along in `CachedPrefix.group_hits`).

        At least one token is always left to compute, because the forward over it produces the
        logits for the next token. With several groups the hit is the longest prefix that every
        group can serve: full groups need each leading block, sliding groups those under the
        window of the first query after the hit.
        """
        if not self.enable_prefix_caching:
            return []
        bs, windows = self.block_size, self.group_windows
        found: list[list[int | None]] = [[] for _ in windows]
        parent: bytes | None = None
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = chain_hash(parent, tokens)
            row = [self._hit(g, parent, tokens) for g in range(len(windows))]
            if any(b is None and w is None for b, w in zip(row, windows)):
                break  # a full group misses: no longer prefix can hit
            for g, b in enumerate(row):
                found[g].append(b)
        n = len(found[0])
        while n > 0 and not all(
            w is None or all(b is not None for b in found[g][self._window_start(w, n * bs) : n])
            for g, w in enumerate(windows)
        ):
            n -= 1
        hits = [
            [
                NULL_BLOCK if b is None or (w is not None and i < self._window_start(w, n * bs)) else b
                for i, b in enumerate(found[g][:n])
            ]
            for g, w in enumerate(windows)
        ]
        out = CachedPrefix(hits[0])
        out.group_hits = hits
        return out

    def cache_full_blocks(self, seq: Sequence, num_ready_tokens: int) -> None:
        """Register the full blocks among the first `num_ready_tokens` tokens for reuse.

        `num_ready_tokens` must count only committed tokens whose K/V is written in every cache
        sharing the block table (target and draft), or a later hit would read garbage.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        tables = self.tables(seq)
        for i in range(len(seq.block_hashes), min(num_ready_tokens // bs, len(seq.block_table))):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = chain_hash(parent, tokens)
            seq.block_hashes.append(h)
            for g, table in enumerate(tables):
                key = self._key(g, h)
                if table[i] == NULL_BLOCK:
                    continue  # handed back before it was registered: never hit in this group
                block = self.blocks[table[i]]
                if block.block_hash is None and key not in self._cached:
                    block.block_hash, block.token_ids = key, tokens
                    self._cached[key] = block.block_id

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
        tables = self.tables(seq)
        group_hits = getattr(cached, "group_hits", None) or [list(cached)] + [[] for _ in tables[1:]]
        start = len(cached) * self.block_size if cached else seq.num_computed_tokens
        self._hand_back_outside_windows(seq, tables, start)
        total_blocks = self.blocks_needed(start + num_new_tokens + num_lookahead)
        first = start // self.block_size
        need = 0
        cows: list[list[int]] = []
        for table, hits in zip(tables, group_hits):
            need += max(0, total_blocks - (len(hits) if cached else len(table)))
            cows.append([] if cached else self._shared_blocks_from(table, first))
        live_hits = {b for hits in group_hits for b in hits if b != NULL_BLOCK}
        revived = sum(1 for b in live_hits if self.blocks[b].ref_count == 0)
        if need + sum(map(len, cows)) > self.num_free_blocks - revived:
            return False
        for b in (b for hits in group_hits for b in hits if b != NULL_BLOCK):
            self._take(b)  # every group's hits first: a later group's hit may sit in the free list
        for table, hits, cow in zip(tables, group_hits, cows):
            table.extend(hits)
            for index in cow:
                self._copy_on_write(seq, table, index)
            while len(table) < total_blocks:
                table.append(self._pop_free())
        return True

    def _hand_back_outside_windows(self, seq: Sequence, tables: list[list[int]], start: int) -> None:
        """Release sliding-group blocks that no query from `start` on (nor a lagging draft's) can see."""
        frontier = min(start, seq.draft_num_computed_tokens) if self.track_draft else start
        for table, window in zip(tables, self.group_windows):
            if window is None:
                continue
            for i in range(min(self._window_start(window, frontier), len(table))):
                if table[i] != NULL_BLOCK:
                    self._release(table[i])
                    table[i] = NULL_BLOCK

    def _shared_blocks_from(self, table: list[int], first_index: int) -> list[int]:
        """Indices in `table` at or after `first_index` that other sequences share."""
        return [
            i for i in range(first_index, len(table)) if table[i] != NULL_BLOCK and self.blocks[table[i]].ref_count > 1
        ]

    def _copy_on_write(self, seq: Sequence, table: list[int], index: int) -> None:
        """Give `seq` a private copy of the shared block at `index` of `table` and queue the data copy."""
        src = table[index]
        dst = self._pop_free()
        self.blocks[src].ref_count -= 1
        table[index] = dst
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
        for table in self.tables(seq):
            for block_id in reversed(table):
                if block_id != NULL_BLOCK:
                    self._release(block_id)
        seq.block_table = []
        seq.group_tables = []
        seq.block_hashes = []

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free blocks past the first `num_tokens` slots (speculative rollback)."""
        keep = self.blocks_needed(num_tokens)
        for table in self.tables(seq):
            for block_id in reversed(table[keep:]):
                if block_id != NULL_BLOCK:
                    self._release(block_id)
            del table[keep:]
        del seq.block_hashes[num_tokens // self.block_size :]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share all of `parent`'s blocks; writes later trigger copy-on-write."""
        if child.block_table:
            raise ValueError(f"request {child.request_id}: cannot fork into a sequence that holds blocks")
        tables = self.tables(parent)
        for table in tables:
            for block_id in table:
                if block_id != NULL_BLOCK:
                    self._take(block_id)
        child.block_table = list(tables[0])
        child.group_tables = [list(t) for t in tables[1:]]
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
