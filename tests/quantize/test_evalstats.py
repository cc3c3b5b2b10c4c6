"""Per-document scores against warsha.evaluate.likelihood, and the standard error of a paired
perplexity ratio against its sampling distribution."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from quantize.evalstats import DocScores, pair, relative_increase


def test_doc_scores_add_up_to_likelihood(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.quantize.quant_fixtures import synthetic_docs
    from warsha.evaluate import document_nll, likelihood

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    docs = synthetic_docs("en", 9, 3) + ["the prophet said " * 40]  # one document longer than a window
    whole = likelihood(model, tok, docs, 64, 4)
    per_doc = DocScores.of(docs, *document_nll(model, tok, docs, 64, 3))
    assert int(per_doc.tokens.sum()) == whole.tokens
    assert per_doc.perplexity == pytest.approx(whole.perplexity, rel=1e-5)
    assert per_doc.bits_per_char == pytest.approx(whole.bits_per_char, rel=1e-5)
    for i in (0, 9):
        alone = likelihood(model, tok, [docs[i]], 64, 1)
        assert float(per_doc.nll[i]) == pytest.approx(alone.nll_nats, rel=1e-4)


def _population(n: int, g: torch.Generator) -> tuple[DocScores, DocScores]:
    """Documents of varied length; model B is worse on average, with per-document noise."""
    tokens = torch.randint(20, 300, (n,), generator=g)
    a = tokens.double() * (3.0 + 0.5 * torch.rand(n, generator=g, dtype=torch.float64))
    b = a + tokens.double() * (0.01 + 0.05 * torch.randn(n, generator=g, dtype=torch.float64))
    return DocScores(b, tokens, 1), DocScores(a, tokens, 1)


def test_standard_error_matches_the_sampling_spread() -> None:
    """Draw many document samples: the spread of the estimate equals the reported error."""
    g = torch.Generator().manual_seed(0)
    pop_b, pop_a = _population(20000, g)
    estimates, errors = [], []
    for _ in range(400):
        idx = torch.randint(0, 20000, (200,), generator=g)
        b = DocScores(pop_b.nll[idx], pop_b.tokens[idx], 1)
        a = DocScores(pop_a.nll[idx], pop_a.tokens[idx], 1)
        rel, se = relative_increase(b, a)
        estimates.append(rel)
        errors.append(se)
    spread = float(torch.tensor(estimates).std())
    assert sum(errors) / len(errors) == pytest.approx(spread, rel=0.15)
    truth = math.exp(float((pop_b.nll - pop_a.nll).sum() / pop_a.tokens.sum())) - 1
    assert sum(estimates) / len(estimates) == pytest.approx(truth, abs=spread / 5)


def test_relative_increase_refuses_different_documents() -> None:
    a = DocScores(torch.ones(3, dtype=torch.float64), torch.tensor([1, 2, 3]), 3)
    b = DocScores(torch.ones(3, dtype=torch.float64), torch.tensor([1, 2, 4]), 3)
    with pytest.raises(ValueError, match="not over the same documents"):
        relative_increase(a, b)


def test_per_document_scores_pair_across_files(tmp_path: Path) -> None:
    """Two runs written to separate files pair as the in-memory scores do (quant_bench --pair)."""
    import json

    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(50, 200, (12,), generator=g)
    runs = {}
    for name, shift in (("a", 0.0), ("b", 0.02)):
        nll = tokens.double() * (3.0 + shift) + torch.randn(12, generator=g, dtype=torch.float64)
        runs[name] = DocScores(nll, tokens, 4000)
        doc = {"results": {name: {"documents": {"ar": runs[name].per_document()}}}}
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    assert DocScores.from_per_document(json.loads(json.dumps(runs["a"].per_document()))).perplexity == pytest.approx(
        runs["a"].perplexity, rel=1e-15
    )
    paired = pair(f"{tmp_path / 'b.json'}:b", f"{tmp_path / 'a.json'}:a")
    assert paired["ar"] == pytest.approx(relative_increase(runs["b"], runs["a"]), rel=1e-12)
    with pytest.raises(SystemExit, match="no per-document scores for 'c'"):
        pair(f"{tmp_path / 'b.json'}:c", f"{tmp_path / 'a.json'}:a")


def test_several_runs_pair_as_their_per_document_mean(tmp_path: Path) -> None:
    """--pair A B C compares A with the document-by-document mean NLL of B and C, by hand."""
    import json

    tokens = torch.tensor([10, 20, 30, 40])
    runs = {
        "a": DocScores(torch.tensor([30.0, 61.0, 89.0, 121.0], dtype=torch.float64), tokens, 500),
        "b": DocScores(torch.tensor([29.0, 60.0, 90.0, 118.0], dtype=torch.float64), tokens, 500),
        "c": DocScores(torch.tensor([31.0, 58.0, 86.0, 120.0], dtype=torch.float64), tokens, 500),
    }
    for name, scores in runs.items():
        doc = {"results": {name: {"documents": {"en": scores.per_document()}}}}
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    mean = DocScores.mean([runs["b"], runs["c"]])
    assert mean.nll.tolist() == [30.0, 59.0, 88.0, 119.0]
    expected = math.exp((301.0 - 296.0) / 100) - 1  # sum of a's NLL over the mean's, per token
    paired = pair(*(f"{tmp_path / n}.json:{n}" for n in "abc"))
    assert paired["en"][0] == pytest.approx(expected, rel=1e-12)
    assert paired["en"] == pytest.approx(relative_increase(runs["a"], mean), rel=1e-12)
    other = DocScores(runs["c"].nll, torch.tensor([10, 20, 30, 41]), 500)
    with pytest.raises(ValueError, match="not over the same documents"):
        DocScores.mean([runs["b"], other])
