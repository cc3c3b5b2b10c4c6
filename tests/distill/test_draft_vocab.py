"""The draft's frequent-token list against a brute-force count."""

from __future__ import annotations

import random
from collections import Counter

from distill.draft_vocab import coverage, frequent_tokens


def test_frequent_tokens_match_a_counter_and_keep_specials_first() -> None:
    rng = random.Random(0)
    docs = [[int(rng.paretovariate(1.2)) % 500 for _ in range(rng.randint(1, 80))] for _ in range(200)]
    counts = Counter(t for d in docs for t in d)
    expected = sorted(counts, key=lambda t: (-counts[t], t))[:40]
    assert frequent_tokens(docs, 40) == expected
    with_specials = frequent_tokens(docs, 40, always=[499, expected[0]])
    assert with_specials[:2] == [499, expected[0]] and len(with_specials) == len(set(with_specials)) == 40
    tokens = [t for d in docs for t in d]
    assert coverage(docs, expected) == sum(t in set(expected) for t in tokens) / len(tokens)
    assert coverage(docs, list(counts)) == 1.0
