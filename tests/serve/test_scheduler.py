"""Scheduler unit tests: plain Python, no torch. A fake 'model' appends token 0 when caught up."""

import pytest

from serve.block_manager import BlockManager
from serve.scheduler import AdmissionError, ScheduledBatch, Scheduler, SchedulerConfig
from serve.sequence import Sequence, SequenceStatus


def make_seq(n_prompt: int, rid: str, max_tokens: int = 4) -> Sequence:
    return Sequence(
        request_id=rid, prompt_token_ids=list(range(1, n_prompt + 1)), max_tokens=max_tokens, arrival_time=0.0
    )


def fake_step(sched: Scheduler, batch: ScheduledBatch) -> None:
    """Advance computed counts like the engine does; append a token when a request caught up."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(1000 + seq.num_output_tokens)
            sched.block_manager.cache_full_blocks(seq, seq.num_computed_tokens)
            if seq.num_output_tokens >= seq.max_tokens:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH)


def run_all(sched: Scheduler, max_steps: int = 1000) -> list[ScheduledBatch]:
    batches = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return batches
        batch = sched.schedule()
        batches.append(batch)
        fake_step(sched, batch)
    raise AssertionError("did not finish")


def test_chunked_prefill_mixed_with_decode() -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_model_len=64), BlockManager(32, 4))
    a, b = make_seq(3, "a"), make_seq(20, "b")
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert first.num_new_tokens == [3, 5]  # a whole, b chunked to the budget
    fake_step(sched, first)
    second = sched.schedule()
    assert second.seqs == [a, b] and second.num_new_tokens == [1, 7]  # decode + next chunk
    fake_step(sched, second)
    run_all(sched)
    assert a.num_output_tokens == 4 and b.num_output_tokens == 4
    sched.block_manager.check_no_leaks()


def test_preemption_by_recompute_under_tiny_pool() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), bm)
    seqs = [make_seq(7, f"r{i}", max_tokens=9) for i in range(3)]
    for s in seqs:
        sched.add(s)
    run_all(sched)
    assert sched.num_preemptions > 0
    for s in seqs:
        assert s.output_token_ids == [1000 + i for i in range(9)]
    bm.check_no_leaks()


def test_fcfs_order_and_max_num_seqs() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=64), BlockManager(32, 4))
    seqs = [make_seq(4, f"r{i}") for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch.seqs == seqs[:2]
    run_all(sched)
    sched.block_manager.check_no_leaks()


def test_spec_lookahead_only_for_decoding_requests() -> None:
    sched = Scheduler(SchedulerConfig(max_model_len=64), BlockManager(32, 4))
    a = make_seq(5, "a", max_tokens=10)
    sched.add(a)
    batch = sched.schedule(num_spec_tokens=3)
    assert batch.num_spec_tokens == [0]
    fake_step(sched, batch)
    batch = sched.schedule(num_spec_tokens=3)
    assert batch.num_new_tokens == [1] and batch.num_spec_tokens == [3]
    assert len(a.block_table) * 4 >= a.num_tokens + 3
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    sched.block_manager.check_no_leaks()


def test_admission_rejects_what_never_fits() -> None:
    sched = Scheduler(SchedulerConfig(max_model_len=32, max_waiting=2, max_tokens_in_flight=60), BlockManager(4, 4))
    with pytest.raises(AdmissionError, match="max_model_len"):
        sched.add(make_seq(30, "long", max_tokens=8))
    with pytest.raises(AdmissionError, match="empty"):
        sched.add(make_seq(0, "empty"))
    with pytest.raises(AdmissionError, match="KV blocks"):
        sched.add(make_seq(10, "big", max_tokens=10))
    sched.add(make_seq(4, "a", max_tokens=4))
    sched.add(make_seq(4, "b", max_tokens=4))
    with pytest.raises(AdmissionError, match="max_waiting") as full:
        sched.add(make_seq(4, "c", max_tokens=4))
    assert full.value.retryable


def test_tokens_in_flight_cap_and_abort() -> None:
    sched = Scheduler(SchedulerConfig(max_model_len=32, max_tokens_in_flight=20), BlockManager(16, 4))
    a = make_seq(8, "a", max_tokens=8)
    sched.add(a)
    with pytest.raises(AdmissionError, match="max_tokens_in_flight") as busy:
        sched.add(make_seq(8, "b", max_tokens=8))
    assert busy.value.retryable
    with pytest.raises(AdmissionError, match="on its own") as never:
        sched.add(make_seq(12, "huge", max_tokens=9))
    assert not never.value.retryable
    sched.schedule()
    assert sched.abort("a") is a and a.status is SequenceStatus.FINISHED_ABORTED
    sched.add(make_seq(8, "b", max_tokens=8))
    assert sched.abort("nope") is None
    sched.abort("b")
    sched.block_manager.check_no_leaks()


def test_prefix_hits_counted() -> None:
    bm = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(SchedulerConfig(max_model_len=64), bm)
    a = make_seq(12, "a", max_tokens=1)
    sched.add(a)
    run_all(sched)
    b = make_seq(12, "b", max_tokens=1)
    sched.add(b)
    batch = sched.schedule()
    assert b.num_cached_prompt_tokens == 8 and batch.num_new_tokens == [4]
    assert sched.prefix_hit_tokens == 8
    fake_step(sched, batch)
    bm.check_no_leaks()


def test_config_validation_names_parameter() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
