"""warsha.progress: readable progress lines when the output is a file, tqdm on a terminal."""

from __future__ import annotations

import io

from warsha.progress import LineProgress, progress


def test_file_output_is_plain_lines() -> None:
    out = io.StringIO()
    bar = LineProgress(range(3, 10), desc="train", total=10, initial=3, unit="step", stream=out, interval=0.0)
    seen = []
    for step in bar:
        seen.append(step)
        bar.set_postfix(loss="1.234")
    text = out.getvalue()
    assert seen == list(range(3, 10))
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[0].startswith("train: 3/10 step (30%)")
    assert lines[-1].startswith("train: 10/10 step (100%)") and "done in" in lines[-1]
    assert lines[-1].endswith("loss=1.234")
    assert len(lines) == 1 + 6 + 1  # start, one per step before the last at interval 0, the final line


def test_interval_bounds_the_line_count() -> None:
    out = io.StringIO()
    for _ in LineProgress(range(1000), desc="x", total=None, stream=out, interval=3600.0):
        pass
    assert len(out.getvalue().splitlines()) == 2  # the start and the end only


def test_short_bar_that_does_not_stay_writes_nothing() -> None:
    out = io.StringIO()
    for _ in progress(range(5), desc="eval", leave=False, stream=out):
        pass
    assert out.getvalue() == ""


def test_disabled_bar_is_silent_but_iterates() -> None:
    out = io.StringIO()
    assert list(progress(range(4), desc="rank1", disable=True, stream=out)) == [0, 1, 2, 3]
    assert out.getvalue() == ""
