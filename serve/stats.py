"""Engine statistics, defined in docs/metrics.md (vLLM's benchmark definitions)."""

from __future__ import annotations

from dataclasses import dataclass, field


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class EngineStats:
    """Counters the engine updates; derived rates are properties."""

    num_steps: int = 0
    num_finished: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_verifications: int = 0
    spec_emitted: int = 0
    spec_steps: int = 0
    lookup_proposed: int = 0  # the part of spec_proposed / spec_accepted that prompt lookup drafted
    lookup_accepted: int = 0
    plain_decode_steps: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    kv_allocated_slots: int = 0
    kv_used_slots: int = 0
    kv_reserved_request_slots: int = 0
    kv_reserved_max_len_slots: int = 0
    kv_usage_peak: float = 0.0
    kv_usage_sum: float = 0.0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    queue_time: list[float] = field(default_factory=list)
    e2e_latency: list[float] = field(default_factory=list)
    requests: list[tuple[float, float | None]] = field(default_factory=list)  # (ttft, tpot) per request

    def record_request(
        self, arrival: float, scheduled: float | None, first_token: float | None, finished: float, num_output: int
    ) -> None:
        """Book one finished request's latencies (seconds, from arrival)."""
        self.num_finished += 1
        if scheduled is not None:
            self.queue_time.append(scheduled - arrival)
        if first_token is None:
            return
        self.ttft.append(first_token - arrival)
        self.e2e_latency.append(finished - arrival)
        tpot = (finished - first_token) / (num_output - 1) if num_output > 1 else None
        if tpot is not None:
            self.tpot.append(tpot)
        self.requests.append((first_token - arrival, tpot))

    def goodput(self, ttft_slo: float, tpot_slo: float) -> float | None:
        """Fraction of finished requests meeting both SLOs (vLLM's goodput, as a ratio)."""
        if not self.requests:
            return None
        ok = sum(1 for ttft, tpot in self.requests if ttft <= ttft_slo and (tpot is None or tpot <= tpot_slo))
        return ok / len(self.requests)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / proposed draft tokens."""
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else None

    @property
    def lookup_acceptance_rate(self) -> float | None:
        """Accepted / proposed over the tokens prompt lookup drafted."""
        return self.lookup_accepted / self.lookup_proposed if self.lookup_proposed else None

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Accepted / proposed over the tokens the draft model drafted."""
        proposed = self.spec_proposed - self.lookup_proposed
        return (self.spec_accepted - self.lookup_accepted) / proposed if proposed else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per target forward, per sequence, over speculative verifications."""
        return self.spec_emitted / self.spec_verifications if self.spec_verifications else None

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Prompt tokens served from cached blocks / prompt tokens looked up."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else None

    @property
    def kv_waste(self) -> float | None:
        """Allocated-but-unused KV slots / allocated slots, over all steps."""
        return 1 - self.kv_used_slots / self.kv_allocated_slots if self.kv_allocated_slots else None

    @property
    def kv_waste_contiguous(self) -> float | None:
        """The waste a contiguous reservation of prompt + max_tokens per request would have had."""
        return 1 - self.kv_used_slots / self.kv_reserved_request_slots if self.kv_reserved_request_slots else None

    @property
    def kv_waste_max_len(self) -> float | None:
        """The waste of reserving max_model_len contiguous slots per request."""
        return 1 - self.kv_used_slots / self.kv_reserved_max_len_slots if self.kv_reserved_max_len_slots else None

    def summary(self) -> dict[str, float | int | None]:
        """Flat dict for reports and JSON: counters, rates, means and p50/p99 latencies (seconds)."""
        out: dict[str, float | int | None] = {
            "steps": self.num_steps,
            "finished": self.num_finished,
            "generated_tokens": self.num_generated_tokens,
            "preemptions": self.num_preemptions,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "lookup_share": self.lookup_proposed / self.spec_proposed if self.spec_proposed else None,
            "lookup_acceptance_rate": self.lookup_acceptance_rate,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "spec_steps": self.spec_steps,
            "plain_decode_steps": self.plain_decode_steps,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "kv_waste": self.kv_waste,
            "kv_waste_contiguous": self.kv_waste_contiguous,
            "kv_waste_max_len": self.kv_waste_max_len,
            "kv_usage_peak": self.kv_usage_peak,
            "kv_usage_mean": self.kv_usage_sum / self.num_steps if self.num_steps else None,
        }
        for name in ("ttft", "tpot", "queue_time", "e2e_latency"):
            values = getattr(self, name)
            out[f"{name}_mean"] = sum(values) / len(values) if values else None
            out[f"{name}_p50"] = percentile(values, 50)
            out[f"{name}_p99"] = percentile(values, 99)
        return out
