"""warsha.speculative against independent references: series sums, brute-force float64 loops,
full-recompute greedy decoding, and Monte-Carlo frequencies of the rejection sampler."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from warsha import speculative as acc


def test_expected_length_is_the_geometric_series() -> None:
    for alpha in (0.0, 0.3, 0.7, 0.99):
        for k in range(1, 9):
            series = sum(alpha**i for i in range(k + 1))
            assert acc.expected_accepted_length(alpha, k) == pytest.approx(series, rel=1e-12)
    assert acc.expected_accepted_length(1.0, 5) == 6.0


def test_expected_speedup_formula() -> None:
    # (1 - 0.8^5) / 0.2 = 3.3616 tokens per round, over 1 + 4 * 0.05 = 1.2 target units
    assert acc.expected_speedup(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2, rel=1e-9)
    assert acc.expected_speedup(0.0, 3, 0.0) == pytest.approx(1.0)
    k, best = acc.best_window(0.8, 0.05)
    assert best == max(acc.expected_speedup(0.8, j, 0.05) for j in range(1, 9))
    assert acc.expected_speedup(0.8, k, 0.05) == best
    with pytest.raises(ValueError, match="alpha"):
        acc.expected_speedup(1.5, 2, 0.1)
    with pytest.raises(ValueError, match="k"):
        acc.expected_speedup(0.5, 0, 0.1)


def test_rejection_sampler_reproduces_the_target_distribution() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.distributions.Dirichlet(torch.ones(6)).sample((2,))
    q = torch.distributions.Dirichlet(torch.ones(6)).sample((1,))
    n_trials, counts, kept = 20000, np.zeros(6), 0
    for _ in range(n_trials):
        x = torch.multinomial(q[0], 1, generator=gen)
        n, nxt = acc.verify(p, q, x, gen)
        counts[int(x) if n == 1 else nxt] += 1
        kept += n
    assert np.abs(counts / n_trials - p[0].numpy()).max() < 0.015
    assert kept / n_trials == pytest.approx(float(torch.minimum(p[0], q[0]).sum()), abs=0.015)


def test_bonus_token_follows_the_last_target_distribution() -> None:
    gen = torch.Generator().manual_seed(1)
    p = torch.distributions.Dirichlet(torch.ones(5)).sample((3,))
    counts = np.zeros(5)
    for _ in range(8000):
        x = torch.stack([torch.multinomial(p[i], 1, generator=gen)[0] for i in range(2)])
        n, nxt = acc.verify(p, p[:2].clone(), x, gen)  # draft == target: always kept
        assert n == 2
        counts[nxt] += 1
    assert np.abs(counts / 8000 - p[2].numpy()).max() < 0.02


@pytest.fixture(scope="module")
def pair(target: Any) -> tuple[Any, Any]:
    from distill.draft import layer_subset

    return target, layer_subset(target, [0]).eval()


def _greedy_reference(model: Any, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def _prompts(tokenizer: Any, corpus: Any, n: int, length: int) -> list[list[int]]:
    texts = corpus.texts("ar", "validation")[: n // 2] + corpus.texts("en", "validation")[: n - n // 2]
    ids = [[tokenizer.bos_token_id] + x for x in tokenizer(texts)["input_ids"]]
    return [x[:length] for x in ids if len(x) >= length][:n]


def test_greedy_speculation_equals_target_greedy(pair: tuple[Any, Any], tokenizer: Any, corpus: Any) -> None:
    target, draft = pair
    prompt = _prompts(tokenizer, corpus, 2, 12)[0]
    want = _greedy_reference(target, prompt, 24)
    for k in (1, 3, 8):
        run = acc.speculative_generate(target, draft, prompt, 24, k, 0.0, torch.Generator().manual_seed(0))
        assert run.tokens[:24] == want, f"k={k}"
        assert run.accepted <= run.proposed == run.rounds * k


def _overlap_reference(target: Any, draft: Any, prompt: list[int]) -> float:
    with torch.inference_mode():
        lp = target(input_ids=torch.tensor([prompt])).logits[0, -1].double().softmax(-1)
        lq = draft(input_ids=torch.tensor([prompt])).logits[0, -1].double().softmax(-1)
    return float(torch.minimum(lp, lq).sum())


def test_first_position_acceptance_matches_analytic(pair: tuple[Any, Any], tokenizer: Any, corpus: Any) -> None:
    """The defining identity of speculative sampling: the first proposal is kept with probability
    sum min(p, q) at the prompt, computed here without any KV cache, in float64."""
    target, draft = pair
    prompts = _prompts(tokenizer, corpus, 5, 10)
    gen = torch.Generator().manual_seed(3)
    kept, analytic = [], []
    for prompt in prompts:
        analytic.append(_overlap_reference(target, draft, prompt))
        for _ in range(160):
            run = acc.speculative_generate(target, draft, prompt, 1, 1, 1.0, gen)
            kept.append(run.kept[0])
            assert run.overlaps[0] == pytest.approx(analytic[-1], abs=1e-4)
    assert abs(np.mean(kept) - np.mean(analytic)) < 0.03
    assert 0.05 < np.mean(analytic) < 0.95  # a pair that disagrees often enough to test


def test_per_position_acceptance_matches_analytic_on_visited(
    pair: tuple[Any, Any], tokenizer: Any, corpus: Any
) -> None:
    target, draft = pair
    prompts = _prompts(tokenizer, corpus, 12, 8)
    stats = acc.empirical_acceptance(target, draft, prompts, ks=[3], temperature=1.0, max_new_tokens=200)[3]
    assert stats.verified > 1800
    assert abs(stats.per_token_acceptance - stats.analytic_on_visited) < 0.03
    assert stats.acceptance_rate <= stats.per_token_acceptance
    assert stats.mean_accepted_length == pytest.approx((stats.accepted + stats.rounds) / stats.rounds)
    assert 1.0 <= stats.mean_accepted_length <= 4.0


def test_analytic_acceptance_matches_bruteforce(pair: tuple[Any, Any], tokenizer: Any, corpus: Any) -> None:
    target, draft = pair
    seqs = [p[: 5 + 7 * i] for i, p in enumerate(_prompts(tokenizer, corpus, 3, 30))]
    got = acc.analytic_acceptance(target, draft, seqs, temperatures=(0.0, 0.7, 1.0), batch_size=2, bf16=False)
    sums, agree, n = {0.7: 0.0, 1.0: 0.0}, 0, 0
    with torch.inference_mode():
        for s in seqs:  # one sequence at a time: no padding, float64
            lt = target(input_ids=torch.tensor([s])).logits[0].double()
            ld = draft(input_ids=torch.tensor([s])).logits[0].double()
            for t in sums:
                sums[t] += float(np.minimum((lt / t).softmax(-1).numpy(), (ld / t).softmax(-1).numpy()).sum())
            agree += int((lt.argmax(-1) == ld.argmax(-1)).sum())
            n += len(s)
    assert got["positions"] == n
    assert got["t0"] == pytest.approx(agree / n, abs=1e-6)
    assert got["t0.7"] == pytest.approx(sums[0.7] / n, abs=1e-4)
    assert got["t1"] == pytest.approx(sums[1.0] / n, abs=1e-4)


def test_vocab_mismatch_is_refused(target: Any, make_config: Any) -> None:
    from transformers import LlamaForCausalLM

    other = LlamaForCausalLM(make_config(target.config.vocab_size - 3, layers=1))
    with pytest.raises(ValueError, match="vocab_size"):
        acc.speculative_generate(target, other, [1, 5], 4, 2, 1.0, torch.Generator())
    with pytest.raises(ValueError, match="vocab_size"):
        acc.analytic_acceptance(target, other, [[1, 5, 6]])


def test_cost_ratio_and_plain_speed(pair: tuple[Any, Any]) -> None:
    target, draft = pair
    cost = acc.measure_cost_ratio(target, draft, context=16, repeats=3)
    assert cost["target_ms"] > 0 and cost["draft_ms"] > 0
    assert cost["cost_ratio"] == pytest.approx(cost["draft_ms"] / cost["target_ms"])
    assert acc.plain_tokens_per_s(target, [[1, 5, 9]], 4, 1.0) > 0
