"""tokenizer_ext.letter_rate: the letters/s ratio and its bootstrap interval.

``python -m benchmarks.arabic_chars_bench`` needs the real recipe's models; what it computes from
what they generated is checked here against a direct computation on counts whose answer is known,
and its options against the errors a user should see.
"""

from __future__ import annotations

import pytest

from tokenizer_ext import letter_rate as bench


def _counts(letters: list[int], seconds: list[float]) -> bench.Counts:
    c = bench.Counts()
    for n, s in zip(letters, seconds, strict=True):
        c.tokens.append(n // 2)
        c.chars.append(n + 3)
        c.letters.append(n)
        c.canonical.append(n // 2)
        c.seconds.append(s)
    return c


def test_ratio_is_total_letters_over_total_seconds() -> None:
    ext = _counts([300, 100, 200], [2.0, 1.0, 1.0])
    base = _counts([100, 100, 100], [1.0, 2.0, 1.0])
    expected = (600 / 4.0) / (300 / 4.0)
    assert bench.letters_per_s_ratio(ext, base, [0, 1, 2]) == pytest.approx(expected)
    # a resample that repeats a prompt counts it twice in both models
    assert bench.letters_per_s_ratio(ext, base, [0, 0]) == pytest.approx((600 / 4.0) / (200 / 2.0))
    assert ext.summary()["arabic_letters_per_s"] == pytest.approx(150.0)
    assert ext.summary()["arabic_letters_per_token"] == pytest.approx(2.0)
    # letters per token ignores the seconds: 600 / 300 tokens against 300 / 150
    assert bench.letters_per_token_ratio(ext, base) == pytest.approx(1.0)
    assert bench.letters_per_token_ratio(ext, _counts([100, 100, 100], [9.0, 9.0, 9.0])) == pytest.approx(1.0)
    doubled = _counts([300, 100, 200], [2.0, 1.0, 1.0])
    doubled.tokens = [t // 2 for t in doubled.tokens]
    assert bench.letters_per_token_ratio(doubled, base) == pytest.approx(600 / 150 / (300 / 150))


def test_bootstrap_interval_brackets_the_ratio_and_collapses_when_prompts_agree() -> None:
    ext = _counts([300, 100, 200, 250, 180], [2.0, 1.0, 1.0, 1.5, 1.2])
    base = _counts([100, 120, 100, 150, 90], [1.0, 2.0, 1.0, 1.1, 0.9])
    lo, hi = bench.bootstrap_interval(ext, base)
    ratio = bench.letters_per_s_ratio(ext, base, list(range(5)))
    assert lo < ratio < hi
    same = _counts([200] * 5, [1.0] * 5)
    lo, hi = bench.bootstrap_interval(same, _counts([100] * 5, [1.0] * 5))
    assert lo == pytest.approx(2.0) and hi == pytest.approx(2.0)


def test_other_script_letters_are_counted_apart() -> None:
    """Latin and Cyrillic letters count as other-script, digits and Arabic punctuation as nothing."""
    c = bench.Counts()
    c.add("قال said сказал، 123", tokens=4, canonical=4, seconds=1.0)
    c.add("ذهب", tokens=1, canonical=1, seconds=1.0)
    assert c.letters == [3, 3] and c.other_script == [10, 0] and c.chars == [20, 3]
    assert c.summary()["other_script_letter_share"] == pytest.approx(10 / 16)
    assert c.summary()["per_prompt"]["texts"][1] == "ذهب"


def test_mode_names() -> None:
    assert bench.mode_name(0.0) == "greedy"
    assert bench.mode_name(1.0) == "T=1"
    assert bench.mode_name(0.7) == "T=0.7"


@pytest.mark.parametrize(("value", "message"), [("1,x", "not a comma list"), ("1,-0.5", ">= 0")])
def test_bad_temperatures_are_named(value: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        bench.parse_temperatures(value)
    assert "--temperatures" in str(err.value) and message in str(err.value)
    assert bench.parse_temperatures("1,0") == [1.0, 0.0]
