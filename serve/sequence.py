"""Request state shared by the scheduler, the block manager and the engine.

Plain Python on purpose (no torch): the control plane must stay cheap to reason about and to
test. A `Sequence` is one request. Its progress is described the vLLM V1 way: `token_ids` is
everything known (prompt + generated), `num_computed_tokens` is how many of those already have
K/V in the cache. Prefill, chunked prefill, prefix-cache hits, decode, recompute after
preemption and speculative verification are all "let num_computed_tokens catch up with
token_ids", so the scheduler needs no separate phases.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class SequenceStatus(enum.Enum):
    """Lifecycle of a request; FINISHED_* values say why it ended."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine failed while running this request (and only this one)

    @property
    def is_finished(self) -> bool:
        """True for every terminal status."""
        return self.value in ("stop", "length", "abort", "error")


@dataclass
class DraftSources:
    """Which proposer has paid for this request lately: decayed drafted tokens accepted per
    verification, for prompt lookup and for the draft model.

    A lookup preempts the draft model only while it has done at least as well: on text that
    loops it wins outright; on text a good draft predicts, a lookup that merely found an earlier
    n-gram would cost the draft's better guesses (and a catch-up forward when the draft resumes).
    A source not yet measured is tried first. A lookup left unused keeps its last record, and is
    tried again after `retry` verifications by the draft model: a lookup that missed once, early,
    kept a record near 0 and never ran again, while the text later looped and lookups would
    have been accepted 96% of the time (on the real recipe's held-out prompts 98 of 416 steps
    found a lookup and did not use it; lookup beside the draft ran 1.44x where lookup alone ran
    1.77x). A retry costs nothing a model step would not: the lookup proposes instead."""

    lookup: float | None = None
    model: float | None = None
    decay: float = 0.7
    retry: int = 8
    since_lookup: int = 0  # verifications by the draft model since a lookup last drafted

    def observe(self, looked_up: bool, accepted: int) -> None:
        """A verification of drafts from one source accepted ``accepted`` of them."""
        old = self.lookup if looked_up else self.model
        new = accepted if old is None else self.decay * old + (1 - self.decay) * accepted
        if looked_up:
            self.lookup, self.since_lookup = new, 0
        else:
            self.model, self.since_lookup = new, self.since_lookup + 1

    def prefers_lookup(self) -> bool:
        """Whether a found lookup should be used over the draft model this step."""
        if self.lookup is None or self.model is None or self.since_lookup >= self.retry:
            return True
        return self.lookup >= self.model


@dataclass
class Sequence:
    """One request and everything the engine tracks about it.

    `params` is the request's sampling parameters; the control plane treats it as opaque and
    only reads `max_tokens` from the dedicated field so that this module needs no sampler import.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    params: Any = None
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    draft_num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)  # block group 0 (full attention when the model has it)
    group_tables: list[list[int]] = field(default_factory=list)  # tables of block groups 1.. (`serve.kv_layout`)
    block_hashes: list[bytes] = field(default_factory=list)
    spec_allowed: bool = True
    draft_sources: DraftSources = field(default_factory=DraftSources)
    spec_window: int | None = None  # this step's draft window from the engine's plan (None: no limit)
    status: SequenceStatus = SequenceStatus.WAITING
    stop_reason: int | str | None = None
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    output_text: str = ""

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """All known tokens: prompt plus generated."""
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the original prompt (unchanged by preemption)."""
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Tokens generated so far."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated so far."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def max_total_tokens(self) -> int:
        """Longest this sequence can become: admission control reserves against this."""
        return self.num_prompt_tokens + self.max_tokens

    @property
    def is_finished(self) -> bool:
        """True once the request stopped, hit its length or was aborted."""
        return self.status.is_finished

    @property
    def is_decoding(self) -> bool:
        """True when only the newest token lacks K/V, i.e. the next forward samples a token."""
        return self.num_computed_tokens == self.num_tokens - 1
