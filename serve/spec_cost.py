"""What a speculative decode step costs, by draft window: a measured table per batch bucket.

The window plan (`serve.spec_window`) trades the tokens a longer window is expected to emit
against what it costs, so it needs the step cost as a function of the window. A line (a fixed
cost plus a cost per drafted token) was the first model, and it is wrong in a way that matters:
the cost is not linear in the window. A verification of two or more query tokens per sequence
leaves the single-token decode kernels, so the cost rises steeply from one drafted token to two
and hardly at all from there on; a line through such points overprices the longest window and
underprices the short ones, and a plan built on it stopped short of the window that paid best.

So the cost is what was measured: the decayed mean step time in bins of the mean window
(drafted tokens per sequence), read back by linear interpolation between measured bins. Where
nothing was measured the table answers optimistically (flat beyond the widest bin, straight
from the plain step below the narrowest), so a window the plan has not tried looks cheap until
it is tried once; measuring it is what corrects the table. Drafting more never costs less, so
the points are made nondecreasing (pool adjacent violators) before they are read: one noisy
slow sample must not make the window above it look cheaper than its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepCostTable:
    """Decayed speculative-step seconds by mean draft window, for one batch-size bucket.

    `bin_width` is in drafted tokens per sequence: at batch 1 every window has its own bin;
    at larger batches the mean window is fractional and neighbours share one. `ema` is the
    weight of a new sample in its bin.
    """

    bin_width: float = 0.5
    ema: float = 0.3
    points: dict[int, tuple[float, float]] = field(default_factory=dict)  # bin -> (mean window, seconds)

    def record(self, window: float, seconds: float) -> None:
        """A speculative step with mean window `window` took `seconds`."""
        key = round(window / self.bin_width)
        old = self.points.get(key)
        if old is None:
            self.points[key] = (window, seconds)
            return
        self.points[key] = (old[0] + self.ema * (window - old[0]), old[1] + self.ema * (seconds - old[1]))

    def curve(self) -> list[tuple[float, float]]:
        """The measured (window, seconds) points by window, with seconds made nondecreasing."""
        points = sorted(self.points.values())
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
