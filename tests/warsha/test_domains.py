"""Other-domain evaluation sets (warsha.domains) and the paired bits/char change (ratio_change)."""

from __future__ import annotations

import math
import random
import re

import pytest

from warsha import domains
from warsha.evaluate import ratio_change


@pytest.mark.parametrize("name", list(domains.DOMAINS))
def test_sets_load_in_a_fixed_order_and_grow_by_prefix(name: str) -> None:
    few, more = domains.load(name, 4), domains.load(name, 12)
    assert few == more[:4] and len(more) == 12
    assert all(len(t) >= domains.DOC_CHARS // 2 for t in more)
    assert len(set(more)) == len(more)


@pytest.mark.parametrize("name", ["ar_msa", "ar_quran"])
def test_arabic_sets_are_arabic_and_stripped_like_the_corpus(name: str) -> None:
    docs = domains.load(name, 8, strip_diacritics=True)
    letters = sum(len(re.findall("[\u0621-\u064a]", t)) for t in docs)
    assert letters > 0.6 * sum(len(t) for t in docs)
    assert not any(re.search("[\u064b-\u065f\u0670\u0640\u06d6-\u06ed]", t) for t in docs)
    if name == "ar_quran":  # the Uthmani text is fully marked: keeping the marks keeps them
        kept = domains.load(name, 8, strip_diacritics=False)
        assert all(re.search("[\u064b-\u065f\u06d6-\u06ed]", t) for t in kept)


def test_english_set_has_no_markdown_or_preface() -> None:
    docs = domains.load("en_essays", 30)
    assert not any("**" in t or t.startswith("#") or "30,000" in t for t in docs)
    assert all(re.search("[A-Za-z]", t) for t in docs)


def test_unknown_and_missing_sets_are_named() -> None:
    assert domains.problems(["ar_msa", "klingon"], "domain_eval") == [
        f"domain_eval[1]: unknown evaluation set 'klingon' (known: {', '.join(domains.DOMAINS)})"
    ]
    with pytest.raises(ValueError, match="unknown evaluation set 'x'"):
        domains.load("x", 1)


def _jackknife_se(after: list[float], before: list[float]) -> float:
    """Leave-one-document-out standard error of sum(after)/sum(before): an independent estimate."""
    n = len(after)
    ratios = [(sum(after) - a) / (sum(before) - b) for a, b in zip(after, before)]
    mean = sum(ratios) / n
    return math.sqrt((n - 1) / n * sum((r - mean) ** 2 for r in ratios))


def test_ratio_change_against_direct_sums_and_the_jackknife() -> None:
    rng = random.Random(0)
    before = [rng.uniform(200, 900) for _ in range(400)]
    after = [b * rng.gauss(1.05, 0.08) for b in before]
    change, se = ratio_change(after, before)
    assert change == pytest.approx(sum(after) / sum(before) - 1, rel=1e-12)
    assert se == pytest.approx(_jackknife_se(after, before), rel=0.05)
    assert ratio_change(before, before) == (pytest.approx(0.0), pytest.approx(0.0))
    with pytest.raises(ValueError, match="same non-empty documents"):
        ratio_change(after[:3], before)
