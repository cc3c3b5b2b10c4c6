"""Sampler and rejection sampler: parameter validation and exact (lossless) distributions."""

import pytest
import torch
from scipy.stats import chisquare

from serve import sampler as sampler_module
from serve.sampler import Sampler, SamplingParams, process_logits, sample
from serve.spec_decode import SpecController, greedy_verify, rejection_sample


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_invalid_params_named(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def _chi2_ok(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the support was emitted"
    expected = probs[support].double() * counts.sum()
    return chisquare(
        counts[support].numpy(), expected.numpy() / expected.sum().item() * counts[support].sum().item()
    ).pvalue


@pytest.mark.parametrize("temperature", [0.5, 1.0])
@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampler_is_lossless(temperature: float, k: int) -> None:
    gen = torch.Generator().manual_seed(int(temperature * 10) + k)
    n, vocab = 60_000, 24
    target_logits = torch.randn(k + 1, vocab, generator=gen) * 1.5
    draft_logits = target_logits[:k] + torch.randn(k, vocab, generator=gen)
    temps = torch.full((k + 1,), temperature)
    top_k, top_p = torch.full((k + 1,), -1), torch.full((k + 1,), 0.9)
    p = process_logits(target_logits, temps, top_k, top_p)
    q = process_logits(draft_logits, temps[:k], top_k[:k], top_p[:k])
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(k)], dim=1)
    result = rejection_sample(
        drafts, q.expand(n, k, vocab), p.expand(n, k + 1, vocab), torch.full((n,), k), [None] * n, gen
    )
    assert _chi2_ok(result.tokens[:, 0], p[0]) > 1e-3
    reached = result.num_accepted >= 1
    assert _chi2_ok(result.tokens[reached, 1], p[1]) > 1e-3
    assert 0 < float(result.num_accepted.float().mean()) < k


def test_rejection_sampler_greedy_and_padding() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 10
    p_logits = torch.randn(2, 4, vocab)
    greedy = torch.zeros(2 * 4)
    p = process_logits(p_logits.reshape(-1, vocab), greedy, torch.full((8,), -1), torch.ones(8)).reshape(2, 4, vocab)
    target_argmax = p_logits.argmax(-1)
    drafts = target_argmax[:, :3].clone()
    drafts[0, 1] = (drafts[0, 1] + 1) % vocab  # row 0 diverges at position 1
    q = torch.zeros(2, 3, vocab).scatter_(-1, drafts[..., None], 1.0)
    res = rejection_sample(drafts, q, p, torch.tensor([3, 2]), [None, None], gen)
    assert res.num_accepted.tolist() == [1, 2]
    assert res.tokens[0, :2].tolist() == target_argmax[0, :2].tolist() and res.tokens[0, 2] == -1
    assert res.tokens[1, :3].tolist() == target_argmax[1, :3].tolist()  # bonus after its 2 real drafts


def test_greedy_verify_equals_rejection_sampling_on_one_hot_distributions() -> None:
    """The fast greedy path must emit exactly what the general sampler emits for T=0."""
    gen = torch.Generator().manual_seed(1)
    vocab, k = 6, 4
    for _ in range(200):
        batch = int(torch.randint(1, 5, (1,), generator=gen))
        counts = torch.randint(1, k + 1, (batch,), generator=gen)
        p_logits = torch.randn(batch, k + 1, vocab, generator=gen)
        flat = p_logits.reshape(-1, vocab)
        zeros = torch.zeros(flat.shape[0])
        p = process_logits(flat, zeros, torch.full((flat.shape[0],), -1), torch.ones(flat.shape[0])).reshape(
            batch, k + 1, vocab
        )
        best = p_logits.argmax(-1)
        drafts = torch.where(
            torch.rand(batch, k, generator=gen) < 0.7, best[:, :k], torch.randint(0, vocab, (batch, k), generator=gen)
        )
        q = torch.zeros(batch, k, vocab).scatter_(-1, drafts[..., None], 1.0)
        slow = rejection_sample(drafts, q, p, counts, [None] * batch, gen)
        past = torch.arange(k + 1)[None, :] > counts[:, None]  # never read: poisoned
        fast = greedy_verify(drafts, best.masked_fill(past, vocab + 7), counts)
        assert torch.equal(fast.tokens, slow.tokens) and torch.equal(fast.num_accepted, slow.num_accepted)


def test_top_k_top_p_masks_and_seeded_sampler() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    probs = process_logits(logits, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([1.0]))
    assert probs[0, 2:].sum() == 0
    probs = process_logits(logits, torch.tensor([1.0]), torch.tensor([-1]), torch.tensor([0.5]))
    assert probs[0, 1:].sum() == 0  # the top token already holds more than half the mass
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0, seed=7)]
    logits = torch.randn(2, 50).repeat(1, 1)
    logits[1] = logits[0]
    a = Sampler(0)(logits, params, [[1], [1]], [[], []], [torch.Generator().manual_seed(7)] * 2).tokens
    b = Sampler(1)(
        logits, params, [[1], [1]], [[], []], [torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)]
    ).tokens
    assert a[0] == b[0]


def test_sample_draws_each_row_from_its_distribution() -> None:
    """Chi-square against the rows' probabilities, zero-mass tokens never drawn, one-hot rows exact."""
    g = torch.Generator().manual_seed(3)
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    n = 20_000
    counts = torch.zeros(2, 6)
    for _ in range(n // 500):
        tokens = torch.stack([sample(probs, [None, None], g) for _ in range(500)])
        counts += torch.nn.functional.one_hot(tokens, 6).sum(0)
    assert counts[0, probs[0] == 0].sum() == 0 and counts[1, 4] == n
    live = probs[0] > 0
    assert chisquare(counts[0, live].numpy(), (n * probs[0, live]).numpy()).pvalue > 1e-3


def test_sample_at_the_top_of_the_unit_interval_takes_the_last_token_with_mass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """u * total rounding up to the total would index past the row; the last live token is drawn."""
    monkeypatch.setattr(sampler_module, "uniform_noise", lambda shape, *a, **k: torch.ones(shape, dtype=torch.float64))
    probs = torch.tensor([[0.2, 0.0, 0.8, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1, 0.6]])
    assert sample(probs, [None, None], torch.Generator()).tolist() == [2, 4]


def test_penalties_and_logprobs() -> None:
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    params = [SamplingParams(temperature=0, repetition_penalty=4.0, logprobs=2)]
    out = Sampler(0)(logits, params, [[0]], [[]], [None])
    assert out.tokens == [1]  # token 0 penalised 2.0 -> 0.5
    assert set(out.logprobs[0]) == {0, 1}  # raw top-2 includes the sampled token
    params = [SamplingParams(temperature=0, frequency_penalty=2.0)]
    assert Sampler(0)(logits.clone(), params, [[3]], [[0]], [None]).tokens == [1]


def test_controller_switches_off_when_speculation_loses() -> None:
    ctl = SpecController(k=4, min_samples=2, probe_every=1000)
    assert ctl.should_speculate(32)  # explore: speculation first
    ctl.record_spec(32, seconds=3.0, proposed=128, accepted=32)
    assert ctl.should_speculate(32)
    ctl.record_spec(32, seconds=3.0, proposed=128, accepted=32)
    assert not ctl.should_speculate(32)  # then the plain side
    ctl.record_plain(32, seconds=1.0)
    ctl.record_plain(32, seconds=1.0)
    assert ctl.predicted_speedup(32) < 1 and not ctl.should_speculate(32)
    assert ctl.cost_ratio(32) == pytest.approx(0.5)
    good = SpecController(k=4, min_samples=2, probe_every=1000)
    for _ in range(2):
        good.record_spec(1, seconds=1.5, proposed=4, accepted=3)
        good.record_plain(1, seconds=1.0)
    assert good.alpha == pytest.approx(0.75) and good.should_speculate(1)  # 4 tokens for 1.5x cost
    assert good.tokens_per_verification == pytest.approx(4.0)
    good.record_spec(1, seconds=None, proposed=4, accepted=0)  # a catch-up step: acceptance only
    assert good.timings[1].spec_samples == 2 and good.timings[1].spec == pytest.approx(1.5)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpecController(k=0)


def test_controller_counts_tokens_emitted_not_an_independent_acceptance_model() -> None:
    """Drafts fail in runs: steps accepting all 4 or none give acceptance 0.5, for which the
    independent-acceptance formula predicts 1.94 tokens per step; the steps emit 3. At 2.2x the
    cost of a plain step speculation wins (3 / 2.2), which that formula would have denied."""
    ctl = SpecController(k=4, min_samples=2, probe_every=1000, decay=1.0)
    for i in range(8):
        ctl.record_spec(1, seconds=2.2, proposed=4, accepted=4 if i % 2 else 0)
        ctl.record_plain(1, seconds=1.0)
    assert ctl.alpha == pytest.approx(0.5)
    assert ctl.tokens_per_verification == pytest.approx(3.0)
    assert ctl.predicted_speedup(1) == pytest.approx(3.0 / 2.2)
    assert ctl.should_speculate(1)
    batch = SpecController(k=4, decay=1.0)
    batch.record_spec(8, seconds=1.0, proposed=32, accepted=12)  # 8 sequences, 1.5 accepted each
    assert batch.tokens_per_verification == pytest.approx(2.5)


def test_controller_probes_long_enough_to_time_speculation_again() -> None:
    """Off after two slow speculative samples; a probe runs two speculative steps (the first is
    an untimed catch-up), the second's timing shows speculation now wins, and it stays on."""
    ctl = SpecController(k=4, min_samples=2, probe_every=4)
    decisions = []
    for _ in range(2):
        decisions.append(ctl.should_speculate(1))
        ctl.record_spec(1, seconds=6.0, proposed=4, accepted=4)  # slow early samples
    for _ in range(2):
        decisions.append(ctl.should_speculate(1))
        ctl.record_plain(1, seconds=1.0)
    assert decisions == [True, True, False, False] and ctl.predicted_speedup(1) < 1
    seen = []
    for _ in range(12):
        spec = ctl.should_speculate(1)
        seen.append(spec)
        if spec:
            catch_up = len(seen) < 2 or not seen[-2]
            ctl.record_spec(1, seconds=None if catch_up else 1.2, proposed=4, accepted=4)
        else:
            ctl.record_plain(1, seconds=1.0)
    first = seen.index(True)
    assert seen[first : first + 2] == [True, True]  # the probe: catch-up, then a timed step
    # speculation (5 tokens for 1.2x the cost) now wins; the only plain steps left are probes
    assert ctl.predicted_speedup(1) > 1
    assert seen[first:].count(True) > seen[first:].count(False)


def test_top_k_top_p_from_candidates_matches_a_full_ranking() -> None:
    """Ranking only the best `width` tokens (and widening for rows whose nucleus reaches past
    them) keeps exactly the tokens a float64 loop over each fully sorted row keeps."""
    from serve.sampler import top_k_top_p

    gen = torch.Generator().manual_seed(5)
    vocab = 3000
    logits = torch.randn(12, vocab, generator=gen) * torch.linspace(0.3, 6.0, 12)[:, None]  # flat to peaky
    k = torch.tensor([vocab, 5, vocab, 40, vocab, 3000, 7, vocab, 100, vocab, 1, 2000])  # vocab: no top-k
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.99, 0.999, 0.3, 1.0, 0.95, 0.8, 0.6, 0.9, 0.97])
    for width in (4, 64, vocab):
        kept = top_k_top_p(logits, k, top_p, width) > float("-inf")
        for row in range(logits.shape[0]):
            probs = logits[row].double().softmax(-1)
            order = probs.argsort(descending=True).tolist()
            want, mass = set(), 0.0
            for rank, tok in enumerate(order):
                if rank >= int(k[row]) or mass > float(top_p[row]):
                    break
                want.add(tok)
                mass += float(probs[tok])
            assert set(kept[row].nonzero()[:, 0].tolist()) == want, (width, row)
