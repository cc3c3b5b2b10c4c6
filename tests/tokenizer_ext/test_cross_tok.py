"""Cross-tokenizer distillation (``tokenizer_ext.cross_tok``) and the embed stage's row fit,
against brute-force references: decoded text for the alignment, a float64 loop for the loss."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tokenizer_ext.conftest import make_ctx
from tokenizer_ext import cross_tok, embed
from tokenizer_ext.stages import EmbedParams
from warsha import lm_loss
from warsha.training import TrainParams


def test_aligned_pairs_match_a_brute_force_search() -> None:
    rng = random.Random(0)
    for _ in range(50):
        ext = [0] + sorted(rng.sample(range(1, 60), 12))
        base = [0] + sorted(rng.sample(range(1, 60), 25))
        want = []
        for i, e in enumerate(ext):
            js = [j for j, b in enumerate(base) if b == e]
            if js and all(ext[k] != e for k in range(i + 1, len(ext))):
                want.append((i, js[-1]))
        assert cross_tok.aligned_pairs(ext, base) == want


def test_windows_align_where_both_models_read_the_same_text(tokenizers: tuple[Any, Any], corpus: Any) -> None:
    """At every pair both prefixes decode to the same text; the window fits seq_len; the new
    pieces make the extended side shorter, so some base positions have no partner."""
    ext_tok, base_tok = tokenizers
    texts = corpus.texts("ar", "validation")[:20]
    windows = cross_tok.sample_windows(texts, 12, ext_tok, base_tok, 48, seed=3)
    skipped = 0
    for w in windows:
        assert len(w.ext_ids) <= 48 and w.pairs[0] == (0, 0)
        for i, j in w.pairs:
            # decoding drops a leading dummy-prefix space on one side or the other
            assert ext_tok.decode(w.ext_ids[1 : i + 1]).lstrip() == base_tok.decode(w.base_ids[1 : j + 1]).lstrip()
        skipped += len(w.base_ids) - len(w.pairs)
        assert ext_tok.decode(w.ext_ids[1:]) == base_tok.decode(w.base_ids[1:])
    assert skipped > 0
    assert sum(len(w.pairs) for w in windows) > 0.8 * sum(len(w.ext_ids) for w in windows)


def _brute_ce(
    hidden: torch.Tensor, weight: torch.Tensor, firsts: torch.Tensor, first_new: int, t_ids: Any, t_p: Any
) -> torch.Tensor:
    """The aggregated cross-entropy, one probability at a time in float64."""
    probs = torch.softmax(hidden.double() @ weight.double().t(), -1)
    total = torch.zeros((), dtype=torch.float64)
    for r in range(hidden.shape[0]):
        for k in range(t_ids.shape[1]):
            b = int(t_ids[r, k])
            mass = probs[r, b]
            for v in range(first_new, first_new + len(firsts)):
                if int(firsts[v - first_new]) == b:
                    mass = mass + probs[r, v]
            total = total - t_p[r, k].double() * torch.log(mass)
    return total / hidden.shape[0]


def test_aggregated_ce_and_gradients_match_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lm_loss, "CHUNK_ELEMENTS", 4 * 32)  # several chunks of 4 rows
    gen = torch.Generator().manual_seed(0)
    base_n, new, pad = 20, 9, 3
    hidden = torch.randn(10, 8, generator=gen, requires_grad=True)
    weight = torch.randn(base_n + new + pad, 8, generator=gen, requires_grad=True)
    firsts = torch.tensor([3, 3, 5, -1, 0, 19, 3, 7, 5])
    t_ids = torch.randint(0, base_n, (10, 4), generator=gen)
    t_p = torch.softmax(torch.randn(10, 4, generator=gen), -1)
    got = cross_tok.aggregated_ce(hidden, weight, firsts, base_n, t_ids, t_p)
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    want = _brute_ce(h64, w64, firsts, base_n, t_ids, t_p)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    got.backward()
    want.backward()
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)


def _fit_params(steps: int, lr: float = 1e-2, **kw: Any) -> EmbedParams:
    train = TrainParams(steps=steps, batch_size=4, seq_len=48, lr=lr, warmup_steps=0, checkpoint_every=100)
    return EmbedParams(fit=train, **{"eval_docs": 0, "domain_eval": [], **kw})


def _held_out_distill(model_dir: Path, tokenizers: tuple[Any, Any], corpus: Any, teacher_dir: Path) -> float:
    """The aggregated cross-entropy of a saved model on held-out windows."""
    from transformers import AutoModelForCausalLM

    ext_tok, base_tok = tokenizers
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    windows = cross_tok.sample_windows(corpus.texts("ar", "validation")[:30], 8, ext_tok, base_tok, 48, seed=9)
    batch = cross_tok.collate(windows, 0)
    batch["labels"][:] = -100  # the distillation term alone
    firsts = cross_tok.first_pieces(embed.base_splits(model_dir, 32000, len(ext_tok)))
    with torch.no_grad():
        return float(cross_tok.loss_fn(teacher, firsts, 32000, 8, 1.0, nll_weight=0.0)(model, batch))


def test_fit_moves_only_new_rows_and_brings_the_model_to_its_base(
    tmp_path: Path, trained_base: Path, tokenizers: tuple[Any, Any], corpus: Any
) -> None:
    from transformers import AutoModelForCausalLM

    unfitted = make_ctx(tmp_path, trained_base, corpus, "embed0")
    embed.run(unfitted, EmbedParams(eval_docs=0, domain_eval=[]))
    ctx = make_ctx(tmp_path, trained_base, corpus, "embed")
    metrics = embed.run(ctx, _fit_params(20, fit_nll_weight=0.0))
    assert metrics["fit"]["steps_run"] == 20
    before = AutoModelForCausalLM.from_pretrained(unfitted.out_dir, dtype=torch.float32).state_dict()
    after = AutoModelForCausalLM.from_pretrained(ctx.out_dir, dtype=torch.float32).state_dict()
    n = len(tokenizers[0])
    for name, value in after.items():
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            torch.testing.assert_close(value[:32000], before[name][:32000], rtol=0, atol=0)
            assert (value[32000:n] - before[name][32000:n]).abs().amax() > 1e-3, name
        else:
            torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    start = _held_out_distill(unfitted.out_dir, tokenizers, corpus, trained_base)
    end = _held_out_distill(ctx.out_dir, tokenizers, corpus, trained_base)
    assert end < 0.9 * start, (start, end)  # measured 2.55 -> 2.02
    shutil.rmtree(ctx.out_dir)


def test_fit_reports_the_rows_before_fitting(tmp_path: Path, sp_extended_dir: Path, corpus: Any) -> None:
    ctx = make_ctx(tmp_path, sp_extended_dir, corpus, "embed")
    m = embed.run(ctx, _fit_params(2, eval_docs=2, eval_max_length=32))
    assert set(m["bits_per_char"]) == {"base", "before_fit", "extended_init"}
    assert m["bits_per_char"]["before_fit"] != m["bits_per_char"]["extended_init"]


def test_fit_replay_cuts_windows_from_text_the_base_writes(
    tmp_path: Path, trained_base: Path, corpus: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fit_replay_fraction``: that share of every batch's windows comes from documents the base
    wrote (``replay.written_texts``, the same for a resumed run), the rest from the corpus."""
    from tokenizer_ext import replay

    seen: list[tuple[int, int]] = []
    real = cross_tok.sample_windows

    def spy(texts: Any, n: int, *args: Any, **kw: Any) -> Any:
        seen.append((len(texts), n))
        return real(texts, n, *args, **kw)

    monkeypatch.setattr(cross_tok, "sample_windows", spy)
    ctx = make_ctx(tmp_path, trained_base, corpus, "embed")
    metrics = embed.run(ctx, _fit_params(2, fit_replay_fraction=0.5, fit_replay_docs=3))
    assert metrics["fit"]["replay_windows_per_batch"] == 2 and metrics["fit"]["replay_docs"] == 3
    assert sorted(set(seen))[0] == (3, 2) and len(seen) == 4  # two steps: corpus windows and written ones
    assert all(n == 2 for _, n in seen)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(trained_base, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(trained_base / "base_tokenizer")
    texts = replay.written_texts(base, tok, "ar", 3, 24, seed=5)
    assert texts == replay.written_texts(base, tok, "ar", 3, 24, seed=5)
    assert all(any("\u0621" <= c <= "\u064a" for c in t) for t in texts), texts


def test_marked_rows_get_the_gradient_the_whole_head_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """A head assembled from frozen rows and trained ones (``mark_trained_rows``, as the fit's
    map builds it): both loss terms give the trained values and the hidden states the gradients
    that autograd through the whole assembled head gives, in float64."""
    from warsha.lm_loss import mark_trained_rows

    monkeypatch.setattr(lm_loss, "CHUNK_ELEMENTS", 4 * 32)
    gen = torch.Generator().manual_seed(1)
    base_n, new = 20, 9
    frozen = torch.randn(base_n + new + 2, 8, generator=gen, dtype=torch.float64)
    firsts = torch.tensor([3, 3, 5, -1, 0, 19, 3, 7, 5])
    t_ids = torch.randint(0, base_n, (10, 4), generator=gen)
    t_p = torch.softmax(torch.randn(10, 4, generator=gen, dtype=torch.float64), -1)
    labels = torch.randint(0, base_n + new, (10,), generator=gen)
    h0 = torch.randn(10, 8, generator=gen, dtype=torch.float64)
    v0 = torch.randn(new, 8, generator=gen, dtype=torch.float64)
    grads = []
    for mark in (False, True):
        hidden, values = h0.clone().requires_grad_(), v0.clone().requires_grad_()
        weight = torch.cat([frozen[:base_n], values, frozen[base_n + new :]])
        if mark:
            mark_trained_rows(weight, torch.arange(base_n, base_n + new), values)
        distill = cross_tok.aggregated_ce(hidden, weight, firsts, base_n, t_ids, t_p)
        from warsha.lm_loss import linear_cross_entropy, linear_cross_entropy_rows, trained_rows

        ones = torch.ones(10, dtype=torch.float64)
        marked = trained_rows(weight)
        assert (marked is not None) == mark
        nll = (
            linear_cross_entropy_rows(hidden, weight, *marked, labels, ones)
            if marked
            else linear_cross_entropy(hidden, weight, labels, ones)
        )
        (distill + nll).backward()
        grads.append((hidden.grad, values.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-10, atol=1e-12)
