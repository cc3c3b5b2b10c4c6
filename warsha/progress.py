"""Progress bars that stay readable when the output is a file.

On a terminal this is tqdm. When stderr is not a terminal (``make demo > log``, CI, a cluster
job's log file) tqdm's carriage-return redraws pile up into one enormous line, so instead a
plain line is written at the start, then at most every ``WARSHA_PROGRESS_SECONDS`` seconds
(default 30), and at the end: the count, the rate, the time left and the postfix fields. A
bar made with ``leave=False`` (a short evaluation inside a stage) writes only if it lasts
longer than one interval.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

DEFAULT_INTERVAL = 30.0


def progress(
    iterable: Iterable[Any],
    *,
    desc: str,
    total: int | None = None,
    initial: int = 0,
    unit: str = "it",
    disable: bool = False,
    leave: bool = True,
    stream: TextIO | None = None,
) -> Any:
    """A tqdm bar on a terminal, a :class:`LineProgress` otherwise; both iterate ``iterable``
    and offer ``set_postfix(**fields)`` and ``write(text)``."""
    out = stream or sys.stderr
    if _is_terminal(out):
        from tqdm.auto import tqdm

        return tqdm(iterable, desc=desc, total=total, initial=initial, unit=unit, disable=disable, leave=leave)
    return LineProgress(
        iterable, desc=desc, total=total, initial=initial, unit=unit, disable=disable, stream=out, leave=leave
    )


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get("WARSHA_PROGRESS_SECONDS", DEFAULT_INTERVAL)))
    except ValueError:
        return DEFAULT_INTERVAL


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class LineProgress:
    """Iterate, writing one self-contained status line every ``interval`` seconds."""

    def __init__(
        self,
        iterable: Iterable[Any],
        *,
        desc: str,
        total: int | None,
        initial: int = 0,
        unit: str = "it",
        disable: bool = False,
        stream: TextIO,
        interval: float | None = None,
        leave: bool = True,
    ) -> None:
        self.iterable, self.desc, self.unit, self.disable, self.stream = iterable, desc, unit, disable, stream
        self.total = total if total is not None else _len_or_none(iterable, initial)
        self.initial = self.n = initial
        self.interval = _interval() if interval is None else interval
        self.postfix: dict[str, str] = {}
        self.leave = leave
        self._lines = 0
        self._t0 = self._last = time.perf_counter()

    def __iter__(self) -> Iterator[Any]:
        if self.leave:
            self._emit()
        for item in self.iterable:
            yield item
            self.n += 1
            now = time.perf_counter()
            if now - self._last >= self.interval and self.n != self.total:  # the end has its own line
                self._emit(now)
        if self.leave or self._lines:
            self._emit(final=True)

    def set_postfix(self, **fields: Any) -> None:
        """Fields shown at the end of the next line (loss, tokens/s, ...)."""
        self.postfix = {k: str(v) for k, v in fields.items()}

    def write(self, text: str) -> None:
        """A message on its own line."""
        if not self.disable:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        """Nothing to clean up (tqdm compatibility)."""

    def line(self, now: float | None = None, final: bool = False) -> str:
        """The status line for the current count."""
        now = time.perf_counter() if now is None else now
        done = self.n - self.initial
        elapsed = now - self._t0
        count = f"{self.n}/{self.total}" if self.total else str(self.n)
        parts = [f"{self.desc}: {count} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        if done and elapsed > 0:
            parts.append(f"{elapsed / done:.2f} s/{self.unit}")
            if self.total and not final:
                parts.append(f"eta {_clock((self.total - self.n) * elapsed / done)}")
        parts.append(("done in " if final else "elapsed ") + _clock(elapsed))
        parts += [f"{k}={v}" for k, v in self.postfix.items()]
        return ", ".join(parts)

    def _emit(self, now: float | None = None, final: bool = False) -> None:
        if self.disable:
            return
        print(self.line(now, final), file=self.stream, flush=True)
        self._lines += 1
        self._last = time.perf_counter() if now is None else now


def _len_or_none(iterable: Iterable[Any], initial: int) -> int | None:
    try:
        return initial + len(iterable)  # type: ignore[arg-type]
    except TypeError:
        return None
