"""Continue a BPE's own training on target-language words: merges on top of its segmentation.

Why not train a fresh BPE and graft its tokens on (what ``byte_bpe`` does): a fresh model
learns from characters, and many of its tokens have no two-piece split under the base's merges
(the base already cut the word differently), so they must be dropped. Continuing instead
starts from what the base tokenizer actually produces for each word and repeatedly adds the
most frequent adjacent pair as a merge ranked after every base merge, exactly the step BPE
training takes. Each added token is therefore the last merge of its own encoding (no dead
token), text without the target script never meets an added merge (English ids unchanged),
and merges are lossless (round trip exact).
"""

from __future__ import annotations

import heapq
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass
class Continued:
    """Merges learned in order, each with the token it makes."""

    merges: list[tuple[str, str]]
    tokens: list[str]
    min_count: int


def learn(
    words: Counter[str],
    segment: Callable[[list[str]], list[list[str]]],
    n_merges: int,
    keep: Callable[[str], bool],
    exists: Callable[[str], bool],
    min_count: int = 2,
) -> Continued:
    """Up to ``n_merges`` merges over ``words`` (word -> count), starting from ``segment``.

    ``keep(token)`` restricts new tokens (e.g. to the target script); a pair whose token
    already exists in the vocabulary (``exists``) cannot be re-added with a new rank and is
    skipped. Ties in frequency go to the lexicographically smaller pair, so runs repeat.
    """
    items = list(words.items())
    seqs = segment([w for w, _ in items])
    counts = [c for _, c in items]
    pair_count: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = defaultdict(set)
    for i, seq in enumerate(seqs):
        for pair in zip(seq, seq[1:]):
            pair_count[pair] += counts[i]
            where[pair].add(i)
    heap = [(-c, pair) for pair, c in pair_count.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    last = 0
    while heap and len(merges) < n_merges:
        neg, pair = heapq.heappop(heap)
        count = pair_count.get(pair, 0)
        if count != -neg:  # stale entry: re-push with the current count
            if count > 0:
                heapq.heappush(heap, (-count, pair))
            continue
        if count < min_count:
            break
        token = pair[0] + pair[1]
        if not keep(token) or exists(token):
            pair_count.pop(pair, None)
            continue
        merges.append(pair)
        last = count
        for i in list(where.pop(pair, ())):
            _apply(i, seqs, counts[i], pair, token, pair_count, where, heap)
        pair_count.pop(pair, None)
    return Continued(merges, [a + b for a, b in merges], last)


def _apply(
    i: int,
    seqs: list[list[str]],
    count: int,
    pair: tuple[str, str],
    token: str,
    pair_count: Counter[tuple[str, str]],
    where: dict[tuple[str, str], set[int]],
    heap: list[tuple[int, tuple[str, str]]],
) -> None:
    """Merge every occurrence of ``pair`` in word ``i`` (left to right, as BPE applies it)."""
    seq = seqs[i]
    for p in zip(seq, seq[1:]):
        pair_count[p] -= count
    out: list[str] = []
    j = 0
    while j < len(seq):
        if j + 1 < len(seq) and seq[j] == pair[0] and seq[j + 1] == pair[1]:
            out.append(token)
            j += 2
        else:
            out.append(seq[j])
            j += 1
    seqs[i] = out
    for p in zip(out, out[1:]):
        pair_count[p] += count
        where[p].add(i)
        if p != pair:
            heapq.heappush(heap, (-pair_count[p], p))


WORD = re.compile(r"\u2581*[^\u2581]+")


def word_counts(texts: Iterable[str], normalise: Callable[[str], str], keep: Callable[[str], bool]) -> Counter[str]:
    """Counts of the words BPE sees: normalised text cut before each run of ``▁`` (the
    SentencePiece space), keeping only words that ``keep`` accepts (target-script words)."""
    out: Counter[str] = Counter()
    for text in texts:
        for w in WORD.findall(normalise(text)):
            if keep(w):
                out[w] += 1
    return out
