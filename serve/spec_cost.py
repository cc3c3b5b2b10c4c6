"""What a speculative decode step costs, by draft window: a measured table per batch bucket.

The window plan (`serve.spec_window`) trades the tokens a longer window is expected to emit
against what it costs, so it needs the step cost as a function of the window. A line (a fixed
cost plus a cost per drafted token) was the first model, and it is wrong in a way that matters:
the cost is not linear in the window. A verification of two or more query tokens per sequence
leaves the single-token decode kernels, so the cost rises steeply from one drafted token to two
and hardly at all from there on; a line through such points overprices the longest window and
underprices the short ones, and a plan built on it stopped short of the window that paid best.

So the cost is what was measured: the median of the recent step times in bins of the mean
window (drafted tokens per sequence), read back by linear interpolation between measured bins.
A median and not a mean: now and then a step is preempted or meets a collection and takes
several times its usual time, and a mean, pushed up by one such step, makes that window look
dear; the plan then stops choosing it, so the bin is never sampled again to correct it. Such
stalls fall on any window alike, so they do not bear on which window to choose. Where
nothing was measured the table answers optimistically (flat beyond the widest bin, straight
from the plain step below the narrowest), so a window the plan has not tried looks cheap until
it is tried; measuring it is what corrects the table. A bin counts once it holds `min_samples`
samples, and a bin the plan has not chosen for `stale_after` steps is emptied: the host's speed
moves during a run, and a window measured dear under one state would otherwise never be tried
under the next. Drafting more never costs less, so
the points are made nondecreasing (pool adjacent violators) before they are read: one noisy
slow sample must not make the window above it look cheaper than its own.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

RECENT = 15  # samples a median looks back over: outvotes a few stalls, follows a change in about 8


@dataclass
class RecentMedian:
    """The median of the last `size` samples (a step time robust to the odd stalled step)."""

    size: int = RECENT
    samples: deque[float] = field(default_factory=deque)

    def add(self, value: float) -> None:
        """One more sample; the oldest beyond `size` is forgotten."""
        self.samples.append(value)
        while len(self.samples) > self.size:
            self.samples.popleft()

    @property
    def value(self) -> float | None:
        """The median, None before any sample."""
        return statistics.median(self.samples) if self.samples else None


@dataclass
class StepCostTable:
    """Recent speculative-step seconds by mean draft window, for one batch-size bucket.

    `bin_width` is in drafted tokens per sequence: at batch 1 every window has its own bin;
    at larger batches the mean window is fractional and neighbours share one. A bin's point is
    the mean of its recent windows and the median of its recent step times.
    """

    bin_width: float = 0.5
    min_samples: int = 3
    stale_after: int = 128
    windows: dict[int, RecentMedian] = field(default_factory=dict)
    seconds: dict[int, RecentMedian] = field(default_factory=dict)
    last: dict[int, int] = field(default_factory=dict)  # bin -> the record count at its last sample
    records: int = 0

    def record(self, window: float, seconds: float) -> None:
        """A speculative step with mean window `window` took `seconds`; stale bins are emptied."""
        key = round(window / self.bin_width)
        self.records += 1
        self.last[key] = self.records
        self.windows.setdefault(key, RecentMedian()).add(window)
        self.seconds.setdefault(key, RecentMedian()).add(seconds)
        for stale in [k for k, at in self.last.items() if self.records - at > self.stale_after]:
            del self.last[stale], self.windows[stale], self.seconds[stale]

    def points(self) -> list[tuple[float, float]]:
        """(window, seconds) of each bin holding `min_samples` samples (of every bin while none
        does: a first sample beats none), by window."""
        bins = [k for k in self.seconds if len(self.seconds[k].samples) >= self.min_samples] or list(self.seconds)
        return sorted((statistics.fmean(self.windows[k].samples), self.seconds[k].value or 0.0) for k in bins)

    def curve(self) -> list[tuple[float, float]]:
        """The measured (window, seconds) points by window, with seconds made nondecreasing."""
        points = self.points()
        blocks: list[tuple[float, int]] = []  # (mean seconds, points pooled)
        for _, seconds in points:
            value, count = seconds, 1
            while blocks and blocks[-1][0] > value:
                prev, n = blocks.pop()
                value, count = (prev * n + value * count) / (n + count), n + count
            blocks.append((value, count))
        pooled = [value for value, count in blocks for _ in range(count)]
        return [(window, seconds) for (window, _), seconds in zip(points, pooled)]

    def cost(self, window: float, plain_seconds: float) -> float | None:
        """A step at mean `window` in plain steps (`plain_seconds` each); None before any sample."""
        curve = self.curve()
        if not curve:
            return None
        lo_x, lo_y = 0.0, plain_seconds
        for x, y in curve:
            if window <= x:
                span = x - lo_x
                seconds = y if span <= 0 else lo_y + (y - lo_y) * (window - lo_x) / span
                return seconds / plain_seconds
            lo_x, lo_y = x, y
        return lo_y / plain_seconds
