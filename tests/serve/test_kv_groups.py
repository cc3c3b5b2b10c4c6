"""Block groups for sliding-window layers, torch-free: layouts, hand-back, memory, prefix hits."""

from __future__ import annotations

import pytest

from serve.block_manager import NULL_BLOCK, BlockManager
from serve.kv_layout import bind_to, layout_for
from serve.sequence import Sequence

GEMMA_LIKE = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))  # 5 sliding : 1 full, window 512


def _seq(n: int, rid: str = "a", base: int = 0) -> Sequence:
    return Sequence(rid, [base + i % 1000 for i in range(n)], max_tokens=8, arrival_time=0.0)


def test_layout_groups_layers_of_one_kind_in_equal_groups() -> None:
    layout = layout_for(GEMMA_LIKE)
    assert layout.group_windows == (None, 512, 512, 512, 512, 512)
    assert layout.layers_per_block == 3
    assert [layout.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]  # the full layers share group 0
    assert sorted(zip(layout.layer_group, layout.layer_slot)) == sorted({*zip(layout.layer_group, layout.layer_slot)})
    assert layout_for((None, None)).group_windows == (None,)  # one kind: today's single table


def test_draft_layers_bind_to_groups_that_cover_their_window() -> None:
    target = layout_for((16, 16, None, 16))
    draft = bind_to((16, None, 8), target)
    assert target.group_windows[draft.layer_group[1]] is None
    assert target.group_windows[draft.layer_group[0]] == 16 and target.group_windows[draft.layer_group[2]] == 16
    with pytest.raises(ValueError, match="no KV group"):
        bind_to((None,), layout_for((16, 16)))  # a full draft layer on an all-sliding target


def _run(bm: BlockManager, seq: Sequence, chunk: int) -> int:
    """Chunked prefill then 8 decode steps; returns the most blocks held at once."""
    peak = 0
    while seq.num_computed_tokens < seq.num_tokens:
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        assert bm.allocate_slots(seq, n)
        peak = max(peak, bm.num_used_blocks)
        seq.num_computed_tokens += n
        bm.cache_full_blocks(seq, seq.num_computed_tokens)
    for t in range(8):
        seq.token_ids.append(t)
        assert bm.allocate_slots(seq, 1)
        peak = max(peak, bm.num_used_blocks)
        seq.num_computed_tokens += 1
    return peak


def test_32k_gemma_like_sequence_holds_at_most_a_quarter_of_all_full() -> None:
    """KV for one 32k-token sequence, 5:1 sliding:full, window 512: all-full would hold every
    block in every group; sliding groups keep only their window (plus the chunk in flight)."""
    layout = layout_for(GEMMA_LIKE)
    bm = BlockManager(20000, 16, group_windows=layout.group_windows, max_chunk_tokens=512)
    seq = _seq(32768)
    peak = _run(bm, seq, 512)
    all_full = layout.num_groups * bm.blocks_needed(seq.num_tokens)
    assert peak <= 0.25 * all_full, (peak, all_full)
    for table, window in zip(bm.tables(seq), layout.group_windows):
        live = [i for i, b in enumerate(table) if b != NULL_BLOCK]
        if window is None:
            assert len(live) == len(table)
        else:  # exactly the blocks under the window of the next query
            assert live == list(range((seq.num_computed_tokens - window + 1) // 16, len(table)))
    assert peak <= bm.blocks_to_hold(seq.num_tokens)
    bm.free(seq)
    bm.check_no_leaks()


def test_prefix_hit_in_sliding_groups_needs_the_window_and_trim_keeps_it() -> None:
    bm = BlockManager(400, 4, group_windows=(None, 16))
    a = _seq(100)
    _run(bm, a, 24)
    bm.free(a)
    b = _seq(120)
    hits = bm.find_cached_prefix(b)
    n = len(hits)
    assert n == 25  # b shares a's first 100 tokens (a's 8 generated tokens differ from b's)
    sliding = hits.group_hits[1]
    first = (n * 4 - 16 + 1) // 4
    assert all(x == NULL_BLOCK for x in sliding[:first]) and NULL_BLOCK not in sliding[first:]
    assert bm.allocate_slots(b, b.num_tokens - n * 4, cached_blocks=hits)
    b.num_computed_tokens = b.num_tokens
    bm.trim(b, 110)  # speculative rollback: tails of both tables go, the window stays
    assert len(b.block_table) == len(b.group_tables[0]) == 28
    bm.free(b)
    bm.check_no_leaks()


def test_admission_counts_every_group() -> None:
    bm = BlockManager(100, 16, group_windows=(None, 64, 64), max_chunk_tokens=64)
    assert bm.blocks_to_hold(1600) == 100 + 2 * 9
    assert BlockManager(100, 16).blocks_to_hold(1600) == 100
