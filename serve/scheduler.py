"""Iteration-level continuous batching with a token budget (vLLM V1 style), no torch.

Every step the scheduler picks, for each request, how many of its not-yet-computed tokens to
run, so prefill chunks and single decode tokens share one forward. Running requests go first
(FCFS order), then waiting ones; a request that cannot get KV blocks preempts the most recently
arrived running request, which frees its blocks and is recomputed later (recompute is cheaper
than swapping on a machine where host memory *is* the KV memory). Admission control rejects at
`add` what could never run, and pushes back when too much work is queued.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from serve.block_manager import BlockManager
from serve.sequence import Sequence, SequenceStatus


class AdmissionError(ValueError):
    """A request was refused at admission; the message says which limit and how to fix it.

    ``retryable`` tells a server whether the same request can succeed later (a full queue, too
    many tokens in flight: HTTP 429) or never will as sent (too long, empty: HTTP 400).
    """

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass
class SchedulerConfig:
    """Limits of one scheduling step and of the queue."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    max_waiting: int = 4096
    max_tokens_in_flight: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens_in_flight is not None and self.max_tokens_in_flight < 1:
            raise ValueError(f"max_tokens_in_flight must be >= 1 or None, got {self.max_tokens_in_flight}")


@dataclass
class ScheduledBatch:
    """What to run this step. `num_spec_tokens[i]` extra slots follow `seqs[i]`'s new tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_spec_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens the target forward processes this step."""
        return sum(self.num_new_tokens) + sum(self.num_spec_tokens)

    @property
    def is_empty(self) -> bool:
        """True when nothing was scheduled."""
        return not self.seqs


class Scheduler:
    """FCFS continuous-batching scheduler over a `BlockManager`."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self._tokens_in_flight = 0

    # ----------------------------------------------------------------- admission
    def add(self, seq: Sequence) -> None:
        """Queue `seq`, or raise AdmissionError if it can never run or the queue is full."""
        cfg = self.config
        if seq.num_prompt_tokens == 0:
            raise AdmissionError(f"request {seq.request_id}: the prompt is empty; give at least one token")
        if seq.max_total_tokens > cfg.max_model_len:
            raise AdmissionError(
                f"request {seq.request_id}: prompt ({seq.num_prompt_tokens} tokens) + max_tokens "
                f"({seq.max_tokens}) = {seq.max_total_tokens} exceeds max_model_len={cfg.max_model_len}; "
                "shorten the prompt or lower max_tokens"
            )
        bm = self.block_manager
        if bm.blocks_to_hold(seq.max_total_tokens) > bm.num_blocks:
            raise AdmissionError(
                f"request {seq.request_id}: needs {bm.blocks_to_hold(seq.max_total_tokens)} KV blocks but the "
                f"cache has only {bm.num_blocks}; raise the KV cache size or lower max_tokens"
            )
        if len(self.waiting) >= cfg.max_waiting:
            raise AdmissionError(
                f"queue full: {len(self.waiting)} requests wait (max_waiting={cfg.max_waiting}); retry later",
                retryable=True,
            )
        limit = cfg.max_tokens_in_flight
        if limit is not None and seq.max_total_tokens > limit:
            raise AdmissionError(
                f"request {seq.request_id}: prompt + max_tokens = {seq.max_total_tokens} tokens exceeds "
                f"max_tokens_in_flight={limit} on its own; lower max_tokens or raise the cap"
            )
        if limit is not None and self._tokens_in_flight + seq.max_total_tokens > limit:
            raise AdmissionError(
                f"request {seq.request_id}: {self._tokens_in_flight} tokens already in flight, adding "
                f"{seq.max_total_tokens} exceeds max_tokens_in_flight={limit}; retry later",
                retryable=True,
            )
        seq.status = SequenceStatus.WAITING
        self._tokens_in_flight += seq.max_total_tokens
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting) or bool(self.running)

    # ----------------------------------------------------------------- scheduling
    def schedule(self, num_spec_tokens: int = 0) -> ScheduledBatch:
        """Choose this step's work; `num_spec_tokens` lookahead slots go to decoding requests."""
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens, num_spec_tokens)
        if not batch.preempted:
            self._schedule_waiting(batch, budget)
        return batch

    def _spec_slots(self, seq: Sequence, num_spec_tokens: int, budget: int) -> int:
        """Lookahead for `seq`: only while decoding, within the budget and its max length."""
        if num_spec_tokens <= 0 or not seq.spec_allowed or not seq.is_decoding:
            return 0
        room = min(seq.max_total_tokens, self.config.max_model_len) - seq.num_tokens - 1
        window = num_spec_tokens if seq.spec_window is None else min(num_spec_tokens, seq.spec_window)
        return max(0, min(window, budget, room))

    def _schedule_running(self, batch: ScheduledBatch, budget: int, num_spec_tokens: int) -> int:
        """Advance running requests in FCFS order, preempting from the back when blocks run out."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            spec = self._spec_slots(seq, num_spec_tokens, budget - num_new)
            while not self.block_manager.allocate_slots(seq, num_new, num_lookahead=spec):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    return budget
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            batch.num_spec_tokens.append(spec)
            budget -= num_new + spec
            i += 1
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        """Admit waiting requests in order while budget, sequence slots and blocks allow."""
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = bm.find_cached_prefix(seq)
            num_cached = len(cached) * bm.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not bm.allocate_slots(seq, num_new, cached_blocks=cached):
                break
            self.waiting.popleft()
            self.prefix_query_tokens += seq.num_tokens
            self.prefix_hit_tokens += num_cached
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = num_cached
            seq.num_computed_tokens = num_cached
            seq.draft_num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            batch.num_spec_tokens.append(0)
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and put it at the head of the queue to be recomputed."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.draft_num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ----------------------------------------------------------------- completion
    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark `seq` finished with `status` and release its blocks."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        self._tokens_in_flight -= seq.max_total_tokens

    def abort(self, request_id: str) -> Sequence | None:
        """Abort the request with `request_id` if it is still queued or running."""
        for seq in list(self.running) + list(self.waiting):
            if seq.request_id == request_id:
                self.finish(seq, SequenceStatus.FINISHED_ABORTED)
                return seq
        return None
