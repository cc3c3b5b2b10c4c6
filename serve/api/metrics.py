"""Prometheus text exposition (format 0.0.4) of the engine's state, without prometheus_client.

The engine thread owns every number: after each step it folds new latencies into histograms
and publishes an immutable `MetricsSnapshot`; the HTTP side only renders the latest snapshot,
so a scrape never touches live engine structures from another thread.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

PREFIX = "warsha"

# Seconds. TTFT spans queueing plus prefill, so it reaches far higher than a per-token time.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class Histogram:
    """Cumulative-on-render histogram: per-bucket counts, sum and count."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)  # the last slot is +Inf

    def observe(self, value: float) -> None:
        """Add one observation (Prometheus buckets are `le`, i.e. upper bounds inclusive)."""
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def copy(self) -> "Histogram":
        """An independent copy for a snapshot."""
        return Histogram(self.buckets, list(self.counts), self.total, self.count)


@dataclass(frozen=True)
class MetricsSnapshot:
    """Everything /metrics reports, taken by the engine thread at one instant."""

    model_name: str
    cpu_isa: str = "none"  # the ISA variant of serve's CPU kernels (serve.cpu_kernels.isa)
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    head_screen_rows: int = 0  # greedy logits rows found through the int8 screen (serve.head_screen)
    head_screen_candidates: int = 0  # head rows computed exactly for them
    finished: dict[str, int] = field(default_factory=dict)
    rejected: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))


def _fmt(value: float) -> str:
    """Prometheus number formatting (integers without a trailing .0)."""
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _labels(**labels: str) -> str:
    escaped = (
        f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"' for k, v in labels.items()
    )
    return "{" + ",".join(escaped) + "}"


def _scalar(lines: list[str], name: str, kind: str, help_text: str, value: float, model: str) -> None:
    lines += [
        f"# HELP {PREFIX}_{name} {help_text}",
        f"# TYPE {PREFIX}_{name} {kind}",
        f"{PREFIX}_{name}{_labels(model_name=model)} {_fmt(value)}",
    ]


def _histogram(lines: list[str], name: str, help_text: str, hist: Histogram, model: str) -> None:
    full = f"{PREFIX}_{name}"
    lines += [f"# HELP {full} {help_text}", f"# TYPE {full} histogram"]
    running = 0
    for bound, n in zip(hist.buckets, hist.counts):
        running += n
        lines.append(f"{full}_bucket{_labels(model_name=model, le=_fmt(bound))} {running}")
    lines.append(f"{full}_bucket{_labels(model_name=model, le='+Inf')} {hist.count}")
    lines.append(f"{full}_sum{_labels(model_name=model)} {_fmt(hist.total)}")
    lines.append(f"{full}_count{_labels(model_name=model)} {hist.count}")


def render(s: MetricsSnapshot) -> str:
    """The snapshot in Prometheus text format."""
    m, lines = s.model_name, []
    _scalar(lines, "num_requests_running", "gauge", "Requests in the running batch.", s.num_running, m)
    _scalar(
        lines,
        "num_requests_waiting",
        "gauge",
        "Requests queued for admission (including preempted ones).",
        s.num_waiting,
        m,
    )
    _scalar(lines, "kv_cache_usage_ratio", "gauge", "Fraction of KV cache blocks in use (0..1).", s.kv_usage, m)
    _scalar(lines, "kv_cache_blocks", "gauge", "KV cache blocks in the pool.", s.num_kv_blocks, m)
    _scalar(lines, "kv_cache_free_blocks", "gauge", "KV cache blocks no request holds.", s.num_free_kv_blocks, m)
    _scalar(
        lines,
        "num_preemptions_total",
        "counter",
        "Requests preempted (blocks freed, recomputed later).",
        s.num_preemptions,
        m,
    )
    _scalar(lines, "prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", s.prompt_tokens, m)
    _scalar(lines, "generation_tokens_total", "counter", "Generated tokens.", s.generation_tokens, m)
    _scalar(lines, "spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.", s.spec_proposed, m)
    _scalar(
        lines,
        "spec_decode_num_accepted_tokens_total",
        "counter",
        "Draft tokens accepted by the target.",
        s.spec_accepted,
        m,
    )
    rate = s.spec_accepted / s.spec_proposed if s.spec_proposed else 0.0
    _scalar(
        lines,
        "spec_decode_acceptance_rate",
        "gauge",
        "Accepted / proposed draft tokens since start (0 without a draft).",
        rate,
        m,
    )
    _scalar(
        lines,
        "head_screen_rows_total",
        "counter",
        "Greedy logits rows whose token the int8 screen of the LM head found (0: screen off or never used).",
        s.head_screen_rows,
        m,
    )
    _scalar(
        lines,
        "head_screen_candidates_total",
        "counter",
        "LM head rows computed exactly for those logits rows (the rest were bounded out).",
        s.head_screen_candidates,
        m,
    )
    lines += [
        f"# HELP {PREFIX}_request_success_total Finished requests by finish reason.",
        f"# TYPE {PREFIX}_request_success_total counter",
    ]
    for reason in FINISH_REASONS:
        lines.append(
            f"{PREFIX}_request_success_total{_labels(model_name=m, finished_reason=reason)} {s.finished.get(reason, 0)}"
        )
    _scalar(
        lines,
        "request_rejected_total",
        "counter",
        "Requests refused at admission because the queue was full.",
        s.rejected,
        m,
    )
    lines += [
        f"# HELP {PREFIX}_cpu_isa_info The ISA variant serve's CPU kernels run (none: off the CPU or without them).",
        f"# TYPE {PREFIX}_cpu_isa_info gauge",
        f"{PREFIX}_cpu_isa_info{_labels(model_name=m, isa=s.cpu_isa)} 1",
    ]
    _histogram(lines, "time_to_first_token_seconds", "Time from arrival to the first generated token.", s.ttft, m)
    _histogram(lines, "time_per_output_token_seconds", "Mean time between output tokens, per request.", s.tpot, m)
    _histogram(lines, "e2e_request_latency_seconds", "Time from arrival to the last token.", s.e2e, m)
    return "\n".join(lines) + "\n"
