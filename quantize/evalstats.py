"""Per-document likelihoods, and the standard error of a perplexity difference.

Why: the perplexity change 4-bit quantization causes on a small model is a fraction of a
percent, about the size of the sampling noise of a few thousand evaluation tokens. A reported
"+0.8% vs -0.56%" means nothing without its standard error. The unit that is sampled is the
document, so the error is computed over documents, *paired* (the same documents score both
models, which cancels most of the between-document variance).

The scoring is ``warsha.evaluate.likelihood``'s loop (``document_windows``, ``scored_batches``),
split by document, so the per-document sums add up to its ``nll_nats`` (a test checks this).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class DocScores:
    """Negative log-likelihood (nats) and scored-token count of each document."""

    nll: torch.Tensor  # float64 [n_docs]
    tokens: torch.Tensor  # int64 [n_docs]
    chars: int

    @property
    def perplexity(self) -> float:
        """Per-token perplexity over all documents (equals ``Likelihood.perplexity``)."""
        return math.exp(float(self.nll.sum()) / max(int(self.tokens.sum()), 1))

    @property
    def bits_per_char(self) -> float:
        """Bits per character over all documents (equals ``Likelihood.bits_per_char``)."""
        return float(self.nll.sum()) / math.log(2) / max(self.chars, 1)

    def per_document(self) -> dict[str, Any]:
        """The per-document arrays, for a file that later runs can be paired against."""
        return {"nll": self.nll.tolist(), "tokens": self.tokens.tolist(), "chars": self.chars}

    @classmethod
    def from_per_document(cls, data: dict[str, Any]) -> DocScores:
        """Inverse of ``per_document``."""
        nll = torch.tensor(data["nll"], dtype=torch.float64)
        return cls(nll=nll, tokens=torch.tensor(data["tokens"], dtype=torch.int64), chars=int(data["chars"]))

    @classmethod
    def mean(cls, runs: Sequence[DocScores]) -> DocScores:
        """Each document's NLL averaged over ``runs`` of the same documents.

        Why: a non-deterministic quantizer (llm-compressor's GPTQ here) gives a different model
        per run; comparing against one run compares against one sample of it, against the mean
        compares against what a user of it gets on average.
        """
        first = runs[0]
        if any(not torch.equal(r.tokens, first.tokens) or r.chars != first.chars for r in runs[1:]):
            raise ValueError("DocScores.mean: the runs are not over the same documents")
        return cls(nll=torch.stack([r.nll for r in runs]).mean(0), tokens=first.tokens.clone(), chars=first.chars)

    def as_dict(self) -> dict[str, float]:
        """Manifest form (the per-document arrays are not written)."""
        return {
            "perplexity": self.perplexity,
            "bits_per_char": self.bits_per_char,
            "tokens": int(self.tokens.sum()),
            "documents": int(self.nll.numel()),
        }

    @classmethod
    def of(cls, texts: Sequence[str], ids: list[list[int]], nll: torch.Tensor) -> DocScores:
        """From ``warsha.evaluate.document_nll``'s ids and sums over ``texts`` (each with BOS)."""
        tokens = torch.tensor([max(len(d) - 1, 0) for d in ids], dtype=torch.int64)
        return cls(nll=nll, tokens=tokens, chars=sum(len(t) for t in texts))


def relative_increase(after: DocScores, before: DocScores) -> tuple[float, float]:
    """``ppl_after / ppl_before - 1`` and its standard error over documents (paired).

    ``log(ppl_a / ppl_b) = sum_d (a_d - b_d) / sum_d t_d`` is a ratio estimator; its
    linearised variance over documents is ``n/(n-1) * sum_d (a_d - b_d - r t_d)^2 / T^2``
    (the delta method then carries it through ``exp``).
    """
    if not torch.equal(after.tokens, before.tokens):
        raise ValueError("relative_increase: the two scores are not over the same documents")
    diff = after.nll - before.nll
    t = after.tokens.double()
    total = float(t.sum())
    r = float(diff.sum()) / total
    n = diff.numel()
    var = float(((diff - r * t) ** 2).sum()) * n / max(n - 1, 1) / total**2
    return math.exp(r) - 1, math.exp(r) * math.sqrt(var)


def pair(after: str, *before: str) -> dict[str, tuple[float, float]]:
    """Relative perplexity change of result ``after`` over ``before`` (each FILE:NAME), per
    language; several ``before`` results are averaged per document first.

    ``python -m benchmarks.quant_bench --pair`` prints it. Why: llm-compressor's GPTQ is not
    deterministic here, so one run's peer is a sample; pairing a Warsha result with the peer's
    from several runs needs the documents, which each result keeps.
    """

    def load(spec: str) -> dict[str, DocScores]:
        path, _, name = spec.rpartition(":")
        result = json.loads(Path(path).read_text())["results"].get(name)
        if result is None or "documents" not in result:
            raise SystemExit(f"--pair: {path} has no per-document scores for {name!r} (written since this option)")
        return {lang: DocScores.from_per_document(d) for lang, d in result["documents"].items()}

    if not before:
        raise SystemExit("--pair: give the result to compare and at least one to compare it with")
    a, bs = load(after), [load(spec) for spec in before]
    langs = [lang for lang in a if all(lang in b for b in bs)]
    return {lang: relative_increase(a[lang], DocScores.mean([b[lang] for b in bs])) for lang in langs}
