"""The metrics every stage reports, defined once (docs/metrics.md).

- fertility: tokens per whitespace-separated word of normalised text;
- bits per character: summed negative log-likelihood in bits over characters, which compares
  models with different tokenizers where per-token perplexity does not;
- perplexity: exp of the mean per-token negative log-likelihood (same tokenizer only).

Likelihoods use strided sliding windows, so documents longer than the model's context are
scored with as much context as the window allows rather than truncated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class Fertility:
    """Token statistics of one tokenizer on one set of texts."""

    tokens: int
    words: int
    chars: int

    @property
    def tokens_per_word(self) -> float:
        """Fertility: the figure that tells what a request costs in tokens."""
        return self.tokens / max(self.words, 1)

    @property
    def chars_per_token(self) -> float:
        """Compression: characters each token carries."""
        return self.chars / max(self.tokens, 1)

    def as_dict(self) -> dict[str, float]:
        """Manifest form."""
        return {
            "tokens_per_word": self.tokens_per_word,
            "chars_per_token": self.chars_per_token,
            "tokens": self.tokens,
            "words": self.words,
            "chars": self.chars,
        }


def fertility(encode: Callable[[list[str]], list[list[int]]], texts: Sequence[str]) -> Fertility:
    """Fertility of ``encode`` (a batch encoder without special tokens) on ``texts``."""
    ids = encode(list(texts))
    return Fertility(
        tokens=sum(len(x) for x in ids),
        words=sum(len(t.split()) for t in texts),
        chars=sum(len(t) for t in texts),
    )


def hf_encoder(tokenizer: Any) -> Callable[[list[str]], list[list[int]]]:
    """A batch encoder over an HF tokenizer that adds no special tokens."""

    def encode(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    return encode


@dataclass
class Likelihood:
    """Summed negative log-likelihood of some texts under a model."""

    nll_nats: float
    tokens: int
    chars: int

    @property
    def bits_per_char(self) -> float:
        """Tokenizer-independent quality: bits to encode each character."""
        return self.nll_nats / math.log(2) / max(self.chars, 1)

    @property
    def perplexity(self) -> float:
        """Per-token perplexity (compare only between models sharing a tokenizer)."""
        return math.exp(self.nll_nats / max(self.tokens, 1))

    def as_dict(self) -> dict[str, float]:
        """Manifest form."""
        return {
            "bits_per_char": self.bits_per_char,
            "perplexity": self.perplexity,
            "tokens": self.tokens,
            "chars": self.chars,
        }


def ratio_change(after: Sequence[float], before: Sequence[float]) -> tuple[float, float]:
    """``sum(after) / sum(before) - 1`` and its standard error over documents, paired.

    ``after`` and ``before`` are per-document negative log-likelihoods of the same documents
    under two models (any tokenizers: the characters are the same, so the ratio of summed NLLs
    is the ratio of bits per character). A ratio estimator: its linearised variance over
    documents is ``n/(n-1) * sum_d (a_d - R b_d)^2 / B^2`` with ``B = sum_d b_d``.
    """
    if len(after) != len(before) or not after:
        raise ValueError(f"ratio_change: need the same non-empty documents, got {len(after)} and {len(before)}")
    total_b = math.fsum(before)
    r = math.fsum(after) / total_b
    n = len(after)
    var = math.fsum((a - r * b) ** 2 for a, b in zip(after, before)) * n / max(n - 1, 1) / total_b**2
    return r - 1.0, math.sqrt(var)


def windows(n: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """Sliding windows ``(begin, end, scored)`` over ``n`` tokens: each window scores only
    its last ``scored`` targets, so every token after the first is scored exactly once."""
    out = []
    prev_end = 1  # token 0 (BOS) is context only, never a target
    begin = 0
    while prev_end < n:
        end = min(begin + max_length, n)
        out.append((begin, end, end - prev_end))
        prev_end = end
        begin = max(end - (max_length - stride), begin + 1) if end < n else end
    return out


Window = tuple[int, int, int]


def document_windows(
    tokenizer: Any, texts: Sequence[str], max_length: int, stride: int | None = None
) -> tuple[list[list[int]], list[tuple[int, Window]]]:
    """Each text's ids (BOS first) and the (document index, window) jobs that score them."""
    stride = stride or max_length // 2
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    ids = [bos + x for x in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
    return ids, [(d, w) for d, doc in enumerate(ids) for w in windows(len(doc), max_length, stride)]


def scored_batches(
    model: Any, ids: list[list[int]], jobs: list[tuple[int, Window]], batch_size: int, desc: str
) -> Iterator[tuple[list[int], "torch.Tensor"]]:
    """The one scoring loop: per batch of ``jobs``, their document indices and float64 NLL rows."""
    import torch

    from warsha.progress import progress

    device = next(model.parameters()).device
    with torch.inference_mode():
        for start in progress(range(0, len(jobs), batch_size), desc=desc, leave=False, unit="batch"):
            batch = jobs[start : start + batch_size]
            yield [d for d, _ in batch], row_nll(model, [(ids[d], w) for d, w in batch], device)


def document_nll(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    max_length: int,
    batch_size: int = 8,
    stride: int | None = None,
    desc: str = "scoring",
) -> tuple[list[list[int]], "torch.Tensor"]:
    """Each text's ids and its summed NLL (nats, float64 [n_docs]), scored as ``likelihood``
    scores them (the same windows, batches of similar widths): the unit paired comparisons
    sample is the document, so its sums are kept apart."""
    import torch

    ids, jobs = document_windows(tokenizer, texts, max_length, stride)
    jobs.sort(key=lambda j: j[1][1] - j[1][0])  # similar widths together: less padding
    nll = torch.zeros(len(ids), dtype=torch.float64)
    for docs, rows in scored_batches(model, ids, jobs, batch_size, desc):
        nll.index_add_(0, torch.tensor(docs), rows)
    return ids, nll


def likelihood(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    max_length: int,
    batch_size: int = 8,
    stride: int | None = None,
    desc: str = "likelihood",
) -> Likelihood:
    """Score ``texts`` (each with BOS) in batched sliding windows of ``max_length``."""
    ids, jobs = document_windows(tokenizer, texts, max_length, stride)
    total = sum(float(rows.sum()) for _, rows in scored_batches(model, ids, jobs, batch_size, desc))
    return Likelihood(
        nll_nats=total,
        tokens=sum(max(len(d) - 1, 0) for d in ids),
        chars=sum(len(t) for t in texts),
    )


LOGITS_BUDGET_BYTES = 1 << 30
"""Float32 logits one scoring forward may hold: a 262k-vocabulary model at 2,048 tokens makes
2.1 GiB of logits per row, so a batch of 8 windows would need 17 GiB before the softmax."""


def row_nll(model: Any, jobs: list[tuple[list[int], tuple[int, int, int]]], device: Any) -> "torch.Tensor":
    """float64 summed NLL (nats) of each window's scored targets, in right-padded forwards.

    Per row, not one total, so that callers can attribute the likelihood to documents (paired
    standard errors in ``quantize.evalstats``); ``likelihood`` just adds the rows up. Rows go
    through the model in groups whose logits fit ``LOGITS_BUDGET_BYTES`` (at least one row).
    """
    import torch

    width = max(end - begin for _, (begin, end, _) in jobs)
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 1)
    rows = max(1, LOGITS_BUDGET_BYTES // (4 * width * vocab))
    return torch.cat([_rows_nll(model, jobs[i : i + rows], width, device) for i in range(0, len(jobs), rows)])


def _rows_nll(
    model: Any, jobs: list[tuple[list[int], tuple[int, int, int]]], width: int, device: Any
) -> "torch.Tensor":
    """One right-padded forward of ``jobs`` padded to ``width`` (``warsha.score_forward``: the
    head only on the scored positions, bf16 where the device is fast at it)."""
    import torch

    from warsha.score_forward import rows_nll

    input_ids = torch.zeros(len(jobs), width, dtype=torch.long)
    labels = torch.full((len(jobs), width), -100, dtype=torch.long)
    mask = torch.zeros(len(jobs), width, dtype=torch.long)
    for row, (doc, (begin, end, scored)) in enumerate(jobs):
        chunk = torch.tensor(doc[begin:end])
        input_ids[row, : len(chunk)] = chunk
        mask[row, : len(chunk)] = 1
        labels[row, len(chunk) - scored : len(chunk)] = chunk[len(chunk) - scored :]
    return rows_nll(model, input_ids.to(device), mask.to(device), labels[:, 1:].to(device)).cpu()


def unigram_bits_per_char(train_ids: Sequence[Sequence[int]], texts: Sequence[str], tokenizer: Any) -> float:
    """Bits per character of an add-one-smoothed unigram model over the same tokenizer.

    The floor any trained language model must beat: it proves the bootstrap model learned
    more than token frequencies.
    """
    from collections import Counter

    counts: Counter[int] = Counter()
    for seq in train_ids:
        counts.update(seq)
    vocab = len(tokenizer)
    total = sum(counts.values()) + vocab
    nll = 0.0
    for seq in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        nll -= sum(math.log((counts[t] + 1) / total) for t in seq)
    return nll / math.log(2) / max(sum(len(t) for t in texts), 1)


# Acceptance-rate metrics live in warsha/speculative.py (their own module, as they drive two
# models); re-exported here so every metric has one import path.
from warsha.speculative import (  # noqa: E402,F401
    SpecStats,
    analytic_acceptance,
    empirical_acceptance,
    expected_accepted_length,
    expected_speedup,
    measure_cost_ratio,
    speculative_generate,
)
