"""Block manager unit tests: plain Python, no torch."""

import subprocess
import sys

import pytest

from serve.block_manager import BlockManager
from serve.sequence import Sequence


def make_seq(tokens: list[int], rid: str = "r", max_tokens: int = 8) -> Sequence:
    return Sequence(request_id=rid, prompt_token_ids=list(tokens), max_tokens=max_tokens, arrival_time=0.0)


def test_control_plane_imports_no_torch() -> None:
    code = "import sys, serve.sequence, serve.block_manager, serve.scheduler; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_allocate_grow_and_free() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))
    assert bm.allocate_slots(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    seq.num_computed_tokens = 10
    assert bm.allocate_slots(seq, 2)  # 12 slots still fit in 3 blocks
    assert len(seq.block_table) == 3
    seq.num_computed_tokens = 12
    assert bm.allocate_slots(seq, 1)
    assert len(seq.block_table) == 4
    bm.free(seq)
    bm.check_no_leaks()


def test_allocation_failure_changes_nothing() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(list(range(12)))
    assert not bm.allocate_slots(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_prefix_cache_hit_shares_blocks_and_keeps_one_token() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(12)), "a")
    assert bm.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a, 12)
    b = make_seq(list(range(12)), "b")
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_table[:2]  # the last full block is recomputed so logits exist
    assert bm.allocate_slots(b, 4, cached_blocks=hits)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.blocks[hits[0]].ref_count == 2
    c = make_seq(list(range(8)) + [99, 98, 97, 96, 95], "c")
    assert bm.find_cached_prefix(c) == a.block_table[:2]
    d = make_seq([7] + list(range(1, 13)), "d")
    assert bm.find_cached_prefix(d) == []  # first block differs, the chain breaks
    bm.free(a)
    bm.free(b)
    bm.check_no_leaks()


def test_freed_cached_blocks_are_revived_then_evicted() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5], "a")
    assert bm.allocate_slots(a, 5)
    bm.cache_full_blocks(a, 5)
    bm.free(a)
    b = make_seq([1, 2, 3, 4, 9], "b")
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 2
    assert bm.allocate_slots(b, 1, cached_blocks=hits)
    assert bm.num_free_blocks == 1
    bm.free(b)
    big = make_seq(list(range(100, 108)), "big")
    assert bm.allocate_slots(big, 8)  # evicts every cached block
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 5])) == []
    bm.free(big)
    bm.check_no_leaks()


def test_copy_on_write_after_fork() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq([1, 2, 3, 4, 5, 6], "p")
    assert bm.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = make_seq([1, 2, 3, 4, 5, 6], "c")
    bm.fork(parent, child)
    assert bm.blocks[parent.block_table[1]].ref_count == 2
    child.token_ids.append(7)
    assert bm.allocate_slots(child, 1)
    assert child.block_table[0] == parent.block_table[0]  # full block still shared
    assert child.block_table[1] != parent.block_table[1]  # partial block copied
    assert bm.take_pending_copies() == [(parent.block_table[1], child.block_table[1])]
    assert bm.take_pending_copies() == []
    bm.free(parent)
    bm.free(child)
    bm.check_no_leaks()


def test_trim_rolls_back_lookahead_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(7)))
    assert bm.allocate_slots(seq, 7, num_lookahead=6)
    assert len(seq.block_table) == 4
    bm.trim(seq, 9)
    assert len(seq.block_table) == 3
    bm.free(seq)
    bm.check_no_leaks()


def test_bad_arguments_named() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=0)
