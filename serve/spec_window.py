"""How many tokens each request drafts this step: per-request acceptance and the goodput plan.

Why per request: how often a draft agrees with the target depends on the text. On the real
recipe's held-out Arabic prompts a fixed window of 4 ran some prompts much faster than plain
decoding and others slower (where the target's greedy text repeats itself in a way the draft
does not follow; docs/results.md has the figures); no single window, and no switch for the whole engine, serves both. So
each request keeps its own acceptance record and gets its own window, down to 0 (plain
decoding) for a request its draft cannot follow.

The acceptance model is conditional per depth: a_j = P(draft token j accepted | tokens 1..j-1
were), counted from the request's verifications (a step that proposed k and accepted m is a
trial at depths 1..min(m+1, k) and a success at 1..m) and decayed so it follows the text.
Conditioning per depth keeps what an independent-acceptance model loses: drafts fail in runs,
so a_2.. are usually higher than a_1. A request with few observations leans on the engine-wide
counts as a prior (`prior_weight` pseudo-trials per depth).

The plan (as SmartSpec, Liu et al. 2024, chooses windows by goodput): a step in which the
batch's B requests draft k_1..k_B tokens costs cost(sum(k_i) / B) plain steps, a function of the
mean window measured per batch bucket (`serve.spec_cost`), and emits sum(E_i(k_i)) tokens with
E_i(k) = 1 + sum_{j<=k} prod_{i<=j} a_i. Each extra draft token of request i adds
prod_{i<=j} a_i tokens, and those gains shrink with depth, so for any total number n of drafted
tokens the best plan takes the n largest gains; the plan scans n against the measured cost. The
cost model sees only the mean window, not the longest one the draft's passes follow: exact at
batch 1, an approximation above it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

LOOKUP_SUFFIX = "#lookup"  # a request's prompt-lookup record: its id and this (`source_key`)
StepCost = Callable[[float], float]  # mean drafted tokens per sequence -> step cost in plain steps


@dataclass
class DepthCounts:
    """Decayed trials and successes per draft depth (index 0 is the first draft token)."""

    trials: list[float]
    successes: list[float]

    @classmethod
    def empty(cls, depth: int) -> DepthCounts:
        """No observations at any of `depth` depths."""
        return cls([0.0] * depth, [0.0] * depth)

    def observe(self, proposed: int, accepted: int, decay: float) -> None:
        """A verification that proposed `proposed` drafts and accepted the first `accepted`."""
        for j in range(len(self.trials)):
            self.trials[j] *= decay
            self.successes[j] *= decay
        for j in range(min(accepted + 1, proposed, len(self.trials))):
            self.trials[j] += 1.0
            self.successes[j] += 1.0 if j < accepted else 0.0

    def rates(self, prior: list[float], weight: float) -> list[float]:
        """Conditional acceptance per depth, shrunk towards `prior` by `weight` pseudo-trials."""
        return [(s + weight * p) / (t + weight) for s, t, p in zip(self.successes, self.trials, prior)]


@dataclass
class WindowPlanner:
    """Per-request acceptance records and the per-step window plan.

    Probes: a request held at window 0 drafts `probe_window` tokens now and then, so a draft
    that starts to follow the text again is noticed (one token is enough to see that; the deeper
    depths then come back through the plan). The first probe comes after `probe_first` idle
    steps and each further one after twice as many, up to `probe_every`: a request goes to
    window 0 on a handful of decayed observations, often during a short stretch its draft
    misses, and only a probe can bring it back, while a request whose draft keeps failing soon
    pays for a probe only once in `probe_every` steps.

    A probe rides on a step that speculates anyway. On a step that would otherwise be plain it
    runs only where it is expected to pay for itself with the engine's acceptance standing in
    for the probed request's: a step with drafts leaves the single-token decode kernels, and at
    a batch of 4 on a 2-core CPU one probing request made the step 1.3x dearer and four of them
    (requests admitted together probe together) 2.7x, for half a token each (docs/results.md).
    A probe that does not pay waits for the next speculating step.
    """

    k: int
    request_decay: float = 0.85
    global_decay: float = 0.98
    prior_weight: float = 2.0
    probe_first: int = 2
    probe_every: int = 16
    probe_window: int = 1
    engine: DepthCounts = field(init=False)
    requests: dict[str, DepthCounts] = field(default_factory=dict)
    idle: dict[str, int] = field(default_factory=dict)  # consecutive steps at window 0
    interval: dict[str, int] = field(default_factory=dict)  # idle steps before the request's next probe

    def __post_init__(self) -> None:
        self.engine = DepthCounts.empty(self.k)

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """Record one verification of `request_id`."""
        counts = self.requests.setdefault(request_id, DepthCounts.empty(self.k))
        counts.observe(proposed, accepted, self.request_decay)
        self.engine.observe(proposed, accepted, self.global_decay)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's records (those of both its proposers)."""
        for key in (request_id, source_key(request_id, True)):
            self.requests.pop(key, None)
            self.idle.pop(key, None)
            self.interval.pop(key, None)

    def rates(self, request_id: str) -> list[float]:
        """The request's conditional acceptance per depth (the engine's, before it has any)."""
        prior = self.engine.rates([1.0] * self.k, 1.0)  # optimistic before anything was seen
        counts = self.requests.get(request_id)
        return prior if counts is None else counts.rates(prior, self.prior_weight)

    def plan(self, request_ids: list[str], cost: StepCost, batch_size: int | None = None) -> dict[str, int]:
        """Window per request maximizing expected tokens per unit of step `cost`.

        `batch_size` is the step's decoding batch (default: the requests planned), over which
        the mean window is taken; requests not allowed to speculate count in it at window 0."""
        windows = best_windows([self.rates(r) for r in request_ids], cost, batch_size)
        plan = dict(zip(request_ids, windows))
        due = []
        for rid in request_ids:
            if plan[rid] > 0:
                self.idle[rid], self.interval[rid] = 0, self.probe_first
                continue
            self.idle[rid] = self.idle.get(rid, 0) + 1
            if self.idle[rid] >= self.interval.get(rid, self.probe_first):
                due.append(rid)
        speculating = any(windows)
        window = min(self.k, self.probe_window)
        take = len(due) if speculating else self.probes_that_pay(len(due), window, cost, batch_size or len(request_ids))
        for rid in due[:take]:
            plan[rid], self.idle[rid] = window, 0
            self.interval[rid] = min(2 * self.interval.get(rid, self.probe_first), self.probe_every)
        return plan

    def probes_that_pay(self, due: int, window: int, cost: StepCost, batch_size: int) -> int:
        """How many of `due` probes of `window` tokens to run on an otherwise plain step of
        `batch_size` requests: the count whose expected tokens per unit cost, at the engine's
        acceptance, beat plain decoding most (0 where none does)."""
        gain = sum(reaches(self.engine.rates([1.0] * self.k, 1.0)[:window]))
        best, best_rate = 0, 1.0
        for m in range(1, due + 1):
            rate = (batch_size + m * gain) / batch_size / cost(m * window / batch_size)
            if rate > best_rate:
                best, best_rate = m, rate
        return best


def source_key(request_id: str, looked_up: bool) -> str:
    """The record a request's drafts are planned and counted under: one per proposer.

    Why apart: prompt lookup and the draft model follow a request's text very differently. On
    the real recipe's held-out prompts a found lookup was accepted 97% of the time and the draft
    model 40%; one shared record held the lookup's windows down to what the draft earned, and
    lookup beside the draft ran 1.41-1.53x where lookup alone ran 1.65-1.80x (docs/results.md)."""
    return f"{request_id}{LOOKUP_SUFFIX}" if looked_up else request_id


def is_lookup_key(key: str) -> bool:
    """Whether `key` (from `source_key`) is a prompt lookup's record."""
    return key.endswith(LOOKUP_SUFFIX)


def best_windows(rates: list[list[float]], cost: StepCost, batch_size: int | None = None) -> list[int]:
    """Draft windows maximizing sum(E_i(k_i)) / cost(sum(k_i) / batch_size) for per-depth `rates`.

    All-zero windows are a plain step and cost 1 (plain tokens count for the `batch_size -
    len(rates)` requests that may not speculate, too). Among speculating plans with n drafted
    tokens the best takes the n largest gains prod_{i<=j} a_i (a request's gains shrink with
    depth, so those form windows): scan n, then keep the best plan only if it beats plain
    decoding.
    """
    if not rates:
        return []
    batch = max(batch_size or 0, len(rates))
    gains = [(reach, row) for row, a in enumerate(rates) for reach in reaches(a)]
    gains.sort(key=lambda g: -g[0])
    best_n, best_rate, tokens = 0, float(batch), float(batch)
    for n, (gain, _) in enumerate(gains, start=1):
        tokens += gain
        rate = tokens / cost(n / batch)
        if rate > best_rate:
            best_n, best_rate = n, rate
    windows = [0] * len(rates)
    for _, row in gains[:best_n]:
        windows[row] += 1
    return windows


def reaches(rates: list[float]) -> list[float]:
    """prod_{i<=j} a_i for each depth j: the chance draft token j is accepted, and the tokens it
    adds to a step's expected output (a request's gains, shrinking with depth)."""
    out, reach = [], 1.0
    for rate in rates:
        reach *= rate
        out.append(reach)
    return out


def linear_cost(per_token: float, fixed: float = 0.0) -> StepCost:
    """A step cost of 1 + fixed + per_token * window plain steps (tests and what-if figures)."""
    return lambda window: 1.0 + fixed + per_token * window
