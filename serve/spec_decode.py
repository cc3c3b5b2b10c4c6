"""Speculative decoding: the exact rejection sampler and the switch that turns speculation off.

Rejection sampling (Leviathan et al.; Chen et al.): the draft proposed d_1..d_k from q; the
target scored all k+1 positions in one forward giving p_1..p_{k+1}. Token d_j is accepted with
probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the emitted token is drawn from
norm(max(0, p_j - q_j)); if all k are accepted a bonus token is drawn from p_{k+1}. Every
emitted token is then distributed exactly as the target alone would sample it. Positions past a
request's own k_i are treated as forced rejections with q = 0, which makes the recovery draw
the plain bonus draw from p, so requests with different k share one batched call.

The switch: with per-token acceptance alpha, a step emits (1 - alpha^(k+1)) / (1 - alpha) tokens
per sequence on average and costs (1 + k c) target-step units, c being the measured cost of a
draft forward relative to a target forward. At large batches the target step becomes
compute-bound, c grows and speculation loses (vLLM measured 1.4-1.8x slowdowns at high load),
so the controller measures both step kinds per batch-size bucket and speculates only where it
wins. Within a speculating step each request drafts its own window (`serve.spec_window`), from
its own acceptance record and the step cost measured per window (`serve.spec_cost`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from serve.sampler import sample, uniform_noise
from serve.spec_cost import RecentMedian, StepCostTable
from serve.spec_window import StepCost, WindowPlanner, is_lookup_key


@dataclass
class RejectionResult:
    """Emitted tokens per row ([B, k+1], -1 past the end) and accepted draft counts."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    num_draft: torch.Tensor,
    generators: list[torch.Generator | None],
    default: torch.Generator,
) -> RejectionResult:
    """Verify draft tokens [B, k] (q [B, k, V]) against the target (p [B, k+1, V]).

    `num_draft[i]` <= k is how many of row i's drafts are real; the rest are padding.
    """
    batch, k = draft_tokens.shape
    device = draft_tokens.device
    p_d = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_d = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    u = uniform_noise((batch, k), generators, default, device=device)
    real = torch.arange(k, device=device)[None, :] < num_draft[:, None]
    accept = (u * q_d < p_d) & real
    num_accepted = accept.long().cumprod(-1).sum(-1)
    zeros = torch.zeros(batch, 1, draft_probs.shape[-1], device=device)
    q_padded = torch.cat([draft_probs * real[..., None], zeros], dim=1)
    rows = torch.arange(batch, device=device)
    p_sel = target_probs[rows, num_accepted]
    residual = (p_sel - q_padded[rows, num_accepted]).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_sel)
    return _emit(draft_tokens, num_accepted, sample(residual, generators, default))


def _emit(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor) -> RejectionResult:
    """Each row's accepted drafts then `final` ([B]) at position num_accepted; -1 past it."""
    batch, k = draft_tokens.shape
    device = draft_tokens.device
    out = torch.full((batch, k + 1), -1, dtype=torch.long, device=device)
    keep = torch.arange(k + 1, device=device)[None, :] < num_accepted[:, None]
    out[:, :k] = torch.where(keep[:, :k], draft_tokens, out[:, :k])
    out[torch.arange(batch, device=device), num_accepted] = final
    return RejectionResult(tokens=out, num_accepted=num_accepted)


def greedy_verify(draft_tokens: torch.Tensor, target_argmax: torch.Tensor, num_draft: torch.Tensor) -> RejectionResult:
    """`rejection_sample` for rows where both p and q are one-hot (temperature 0), without them.

    Accept drafts while they equal the target's argmax; then emit the target's argmax at the
    first mismatch (the residual max(0, p - q) is p's one-hot) or as the bonus token.
    `target_argmax` is [B, k + 1]; row i's entries past num_draft[i] + 1 are never read.
    Batched tensor ops on the drafts' device, nothing read back.
    """
    batch, k = draft_tokens.shape
    real = torch.arange(k, device=draft_tokens.device)[None, :] < num_draft[:, None]
    accepted = ((draft_tokens == target_argmax[:, :k]) & real).long().cumprod(-1).sum(-1)
    final = target_argmax.gather(1, accepted[:, None])[:, 0]
    return _emit(draft_tokens, accepted, final)


def _bucket(batch_size: int) -> int:
    """Batch sizes grouped by powers of two: step cost changes slowly within a bucket."""
    return max(1, batch_size).bit_length()


@dataclass
class _Timing:
    """Smoothed step times and sample counts for one batch-size bucket."""

    plain: float | None = None  # the median of recent plain steps (`plain_recent`)
    spec: float | None = None  # smoothed speculative step (what `predicted_speedup` compares)
    window: float | None = None  # mean tokens drafted per sequence in the timed speculative steps
    costs: StepCostTable = field(default_factory=StepCostTable)  # steps in which the draft model ran
    lookup_costs: StepCostTable = field(default_factory=StepCostTable)  # steps of prompt lookups alone
    plain_recent: RecentMedian = field(default_factory=RecentMedian)
    plain_samples: int = 0
    spec_samples: int = 0
    steps: int = 0
    probe_left: int = 0  # steps of the current probe still to run
    probe_spec: bool = False  # the mode being probed
    next_probe: int = 0  # the step count at which the next probe starts (0: not scheduled yet)
    spec_interval: int = 0  # steps to the next probe of speculation while it loses (backs off)


@dataclass
class SpecController:
    """Decides per step whether to speculate, from measured acceptance and step costs.

    Until `min_samples` speculative and plain decode steps have been timed in a batch-size
    bucket it explores (speculating first, the optimistic choice); afterwards it speculates only
    where predicted speedup >= 1, and every `probe_every` steps tries the other mode for
    `probe_steps` steps so the decision follows changes in load and acceptance. A probe of
    speculation that leaves the decision at plain doubles the interval to the next one, up to
    `max_probe_every`, and a decision for speculation resets it: where speculation keeps losing
    (a batch of 4 on two cores, where a verification row costs what a decoded one does) its
    probes cost 2.7x a plain step each and, at a fixed interval, 2% of the run. A probe of
    speculation lasts two steps because its first step feeds the draft the tokens it missed and
    is not timed: with one-step probes the speculative timing was never refreshed, and a couple
    of early slow samples could keep a run plain for good. A probe of plain decoding is one step
    (the target has nothing to catch up on). What a speculative step buys is
    measured directly, as the decayed mean of tokens each sequence emitted per verification, not
    derived from the acceptance rate through (1 - a^(k+1)) / (1 - a): that formula assumes every
    draft token is accepted independently, but drafts fail in runs (a step accepts all k or
    none), so it underestimates what speculation emits and switched off drafts that paid.
    Decayed ratios of sums are steadier than averaging per-step ratios of a few tokens.

    `plan` is what the engine asks: it keeps the exploration and probes above and, where they
    do not force a mode, gives each request its own window (`serve.spec_window`); the bucket
    speculates when any window is above 0. `k` is then the largest window.
    """

    k: int
    adaptive: bool = True
    probe_every: int = 32
    max_probe_every: int = 256
    probe_steps: int = 2
    probe_window: int = 1
    min_samples: int = 2
    ema: float = 0.25
    decay: float = 0.95
    timings: dict[int, _Timing] = field(default_factory=dict)
    windows: WindowPlanner = field(init=False)
    _proposed: float = 0.0
    _accepted: float = 0.0
    _emitted: float = 0.0  # decayed tokens emitted by speculating sequences ...
    _verified: float = 0.0  # ... over decayed sequence-verifications

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 when a draft is given, got {self.k}")
        self.windows = WindowPlanner(self.k)

    @property
    def alpha(self) -> float | None:
        """Smoothed per-token acceptance rate, None before any proposal."""
        return self._accepted / self._proposed if self._proposed else None

    @property
    def tokens_per_verification(self) -> float | None:
        """Smoothed tokens a sequence emits per speculative step (accepted + 1), None before any."""
        return self._emitted / self._verified if self._verified else None

    def should_speculate(self, batch_size: int) -> bool:
        """Speculate unless measurements for this batch size say plain decoding is faster."""
        if not self.adaptive:
            return True
        return self._mode(batch_size, lambda: self.predicted_speedup(batch_size) >= 1.0) != "plain"

    def plan(self, request_ids: list[str], batch_size: int, timed: bool = True) -> dict[str, int]:
        """Draft window of each speculation-eligible decoding request this step (0: plain).

        `batch_size` counts every decoding request (it picks the timing bucket); `timed` is False
        for a step that also prefills, which the switch does not time: such a step does not
        explore (it would pay for speculation and learn nothing; a bucket of 2-3 decoding
        requests may only ever occur beside a prefill, and explored in every one). Exploration
        gives every request the full window, a probe of speculation `probe_window` tokens (it
        is there to time a speculative step and refresh acceptance, and a long window is what
        a probe of a losing draft can least afford); otherwise each request's window comes from
        its own acceptance and the bucket's measured step cost by window.
        """
        if not self.adaptive:
            return dict.fromkeys(request_ids, self.k)
        planned: dict[str, int] = {}

        def wins() -> bool:
            lookup_only = all(is_lookup_key(r) for r in request_ids)
            planned.update(self.windows.plan(request_ids, self.step_cost(batch_size, lookup_only), batch_size))
            return any(planned.values())

        mode = self._mode(batch_size, wins, timed)
        if mode == "plan":
            return planned
        window = {"explore": self.k, "probe": min(self.k, self.probe_window), "plain": 0}[mode]
        return dict.fromkeys(request_ids, window)

    def _mode(self, batch_size: int, wins: Callable[[], bool], timed: bool = True) -> str:
        """ "explore" or "probe" (speculate), "plain", or "plan" (speculate as `wins()` planned).

        `wins()` decides unless exploring or probing forces a mode; an untimed step (`plan`)
        does not explore."""
        t = self.timings.setdefault(_bucket(batch_size), _Timing())
        t.steps += 1
        if t.spec_samples < self.min_samples:
            return "explore" if timed else "plain"
        if t.plain_samples < self.min_samples:
            return "plain"
        if t.probe_left > 0:
            t.probe_left -= 1
            return "probe" if t.probe_spec else "plain"
        won = wins()
        if won or not t.spec_interval:
            t.spec_interval = self.probe_every
        if t.steps >= (t.next_probe or self.probe_every):
            t.next_probe = t.steps + (self.probe_every if won else t.spec_interval)
            if not won:  # the next probe of a losing speculation waits twice as long
                t.spec_interval = min(2 * t.spec_interval, self.max_probe_every)
            t.probe_spec, t.probe_left = not won, 0 if won else self.probe_steps - 1
            return "plain" if won else "probe"
        return "plan" if won else "plain"

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """One verification of `request_id`: `accepted` of its `proposed` drafts held."""
        self.windows.observe(request_id, proposed, accepted)

    def forget(self, request_id: str) -> None:
        """A request finished: drop its acceptance record."""
        self.windows.forget(request_id)

    def predicted_speedup(self, batch_size: int) -> float:
        """Expected speedup of speculation over plain decoding at `batch_size` (1.0 if unknown)."""
        t = self.timings.get(_bucket(batch_size))
        tokens = self.tokens_per_verification
        if t is None or t.plain is None or t.spec is None or tokens is None:
            return 1.0
        return tokens * t.plain / t.spec

    def cost_ratio(self, batch_size: int) -> float | None:
        """c in 1 + k c: a speculative step's extra cost per draft token, in target-step units."""
        t = self.timings.get(_bucket(batch_size))
        if t is None or t.plain is None or t.spec is None or not t.window:
            return None
        return max(0.0, t.spec / t.plain - 1) / t.window

    def step_cost(self, batch_size: int, lookup_only: bool = False) -> StepCost:
        """A speculative step's cost in plain steps at `batch_size`, as a function of the mean
        window: the bucket's measured table (`serve.spec_cost`); free before anything is timed.

        `lookup_only`: every drafting request proposes by prompt lookup, so no draft forward
        runs; such steps have their own table (on the real recipe a 4-token window cost 1.6
        plain steps by lookup and 2.0 by the draft model, and one table priced the model's
        windows at the lookup's). Either table stands in for the other until it has points."""
        t = self.timings.get(_bucket(batch_size))
        if t is None or t.plain is None:
            return lambda window: 1.0
        plain = t.plain
        first, other = (t.lookup_costs, t.costs) if lookup_only else (t.costs, t.lookup_costs)
        table = first if first.curve() else other
        return lambda window: table.cost(window, plain) or 1.0

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ema) * old + self.ema * new

    def record_plain(self, batch_size: int, seconds: float) -> None:
        """A decode-only step without speculation took `seconds`."""
        t = self.timings.setdefault(_bucket(batch_size), _Timing())
        t.plain_recent.add(seconds)
        t.plain = t.plain_recent.value
        t.plain_samples += 1

    def record_spec(
        self, batch_size: int, seconds: float | None, proposed: int, accepted: int, lookup_only: bool = False
    ) -> None:
        """A decode-only speculative step of `batch_size` sequences took `seconds` and accepted
        `accepted` of `proposed` draft tokens (each sequence also emits one token of its own).

        `seconds` is None for a step whose draft first had to catch up on tokens decoded while
        speculation was off: timing it would charge the catch-up to speculation and bias the
        switch towards staying off.
        """
        t = self.timings.setdefault(_bucket(batch_size), _Timing())
        if seconds is not None:
            x = proposed / batch_size
            t.spec = self._smooth(t.spec, seconds)
            t.window = self._smooth(t.window, x)
            (t.lookup_costs if lookup_only else t.costs).record(x, seconds)
            t.spec_samples += 1
        self._proposed = self.decay * self._proposed + proposed
        self._accepted = self.decay * self._accepted + accepted
        self._emitted = self.decay * self._emitted + accepted + batch_size
        self._verified = self.decay * self._verified + batch_size
