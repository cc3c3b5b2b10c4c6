"""The screened LM head (`serve.head_screen`): the whole head's argmax from an int8 copy.

References: the whole head's own kernel (the argmax a greedy step takes without the screen, and
the exact logits at the candidate rows, bit for bit) and float64 products on the same weights
(the bound on every int8 logit). Heads with duplicated and nearly duplicated rows put ties and
near-ties at the top. Served models: greedy tokens with the screen equal those without it, the
screen runs only for argmax-only requests, and sampled, penalised or logprob requests read the
whole head. Every kernel variant the CPU runs (`isa` fixture).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serve import LLM, SamplingParams, cpu_kernels
from serve.head_screen import HeadScreen
from serve.sampler import GumbelDraw, gumbel_noise
from tests.serve.conftest import make_model

pytestmark = [
    pytest.mark.skipif(not cpu_kernels.available(), reason="serve's CPU kernels did not build here"),
    pytest.mark.usefixtures("isa"),
]


def _head(v: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows with a few duplicated (exact ties) and nearly duplicated ones (near-ties)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, k, generator=g) * 0.05
    w[v // 2 : v // 2 + 5] = w[10]  # exact copies of row 10, after it
    w[v // 3] = w[20] * (1 + 2**-9)  # within a bf16 step of row 20
    return w.to(dtype).contiguous()


def _rows(n: int, k: int, dtype: torch.dtype, seed: int, w: torch.Tensor) -> torch.Tensor:
    """Activations with outliers, some pointing at the duplicated rows so the ties are the maximum."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g)
    x[:, torch.randint(0, k, (3,), generator=g)] *= 25
    x[0] = w[10].float() * 400 + x[0] * 0.01  # the top logits tie (rows 10 and its copies)
    if n > 1:
        x[1] = w[20].float() * 400 + x[1] * 0.01  # near-tie between row 20 and its near copy
    return x.to(dtype)


def _whole(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The whole head through its decode kernel, float32: what a step without the screen reads."""
    return HeadScreen.exact(x, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_screened_argmax_is_the_whole_heads_and_candidates_are_bitwise(dtype: torch.dtype, rows: int) -> None:
    w = _head(3000, 96, dtype, seed=rows)
    screen = HeadScreen(w)
    for seed in range(6):
        x = _rows(rows, 96, dtype, seed, w)
        whole = _whole(x, w)
        got = screen.logits(x)
        assert torch.equal(got.argmax(-1), whole.argmax(-1))
        exact = got == whole
        assert exact.any(dim=0).sum() >= 1
        assert screen.candidates < screen.calls * 3000  # it screened something out
    x = _rows(rows, 96, dtype, 0, w)
    assert int(screen.logits(x)[0].argmax()) == 10  # the tie goes to the first index, as argmax's


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_logits_stay_within_the_bound_of_float64_products(dtype: torch.dtype) -> None:
    w = _head(2000, 200, dtype, seed=7)
    screen = HeadScreen(w)
    x = _rows(3, 200, dtype, 3, w)
    approx = cpu_kernels.gemv_int8(x, screen.q, screen.scale, torch.float32).double()
    true = x.double() @ w.double().T
    a, c = screen.bounds(x)
    bound = a.double()[:, None] * screen.scale.double() + c.double()[:, None] * screen.scale_l1.double()
    assert ((approx - true).abs() <= bound).all()
    assert (bound < true.abs().amax(dim=1, keepdim=True)).all()  # a bound that screens


def test_candidates_match_a_brute_force_selection() -> None:
    g = torch.Generator().manual_seed(0)
    approx = torch.randn(3, 1003, generator=g) * 4
    scale, scale_l1 = torch.rand(1003, generator=g), torch.rand(1003, generator=g)
    a, c = torch.rand(3, generator=g), torch.rand(3, generator=g)
    got = cpu_kernels.screen_candidates(approx, scale, scale_l1, a, c, 2.0**-7, 0.25)
    bound = a[:, None] * scale + c[:, None] * scale_l1
    low, high = (approx - bound).amax(1), (approx + bound).amax(1)
    floor = low - torch.maximum(low.abs(), high.abs()) * 2.0**-7 - 0.25
    want = [v for v in range(1003) if any(float(approx[m, v] + bound[m, v]) >= float(floor[m]) for m in range(3))]
    assert got.tolist() == want


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with a 17k-row head: large enough for the engine to screen it."""
    return make_model(tmp_path_factory.mktemp("screen"), seed=5, vocab_size=17000)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_served_greedy_tokens_equal_the_whole_heads(big_vocab: Path, dtype: str) -> None:
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 60))]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(big_vocab, dtype=dtype, head_screen=False)
    screened = LLM(big_vocab, dtype=dtype)
    for batch in ([prompts[0]], prompts):  # batch 1 and 3
        want = [o.token_ids for o in plain.generate(batch, greedy)]
        assert [o.token_ids for o in screened.generate(batch, greedy)] == want
    screen = screened.runner.target.screen
    # bf16 rows take the whole head's kernel only where the variant has one for them (not avx2
    # on a native-bf16 CPU, where oneDNN runs bf16 heads and nothing is screened)
    assert screen is not None or (dtype == "bfloat16" and screened.runner.target.head.kernel_max_rows == 0)
    assert screen is None or screen.calls > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_speculative_greedy_verification_is_screened_and_unchanged(big_vocab: Path, dtype: str) -> None:
    """Prompt lookup drafts 3 tokens: the target scores 4 rows per step, each through the screen."""
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    spec = {"prompt_lookup_max": 3, "num_speculative_tokens": 3}
    want = [o.token_ids for o in LLM(big_vocab, dtype=dtype, head_screen=False, **spec).generate(prompts, greedy)]
    screened = LLM(big_vocab, dtype=dtype, **spec)
    assert [o.token_ids for o in screened.generate([prompts[0]], greedy)] == want[:1]
    assert [o.token_ids for o in screened.generate(prompts, greedy)] == want
    target = screened.runner.target
    assert screened.stats.lookup_proposed > 0  # drafts were verified
    assert target.screen is None or (target.screen.calls > 0 and target.screen_rows >= 4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_served_gumbel_draws_equal_the_whole_heads(big_vocab: Path, dtype: str) -> None:
    """Seeded plain sampling (no top-k/top-p): the same tokens with and without the screen, in a
    batch that mixes greedy and sampled rows, and the screen ran."""
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 60))]
    params = [
        SamplingParams(temperature=0.9, max_tokens=12, seed=4, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.3, max_tokens=12, seed=5, ignore_eos=True),
    ]
    want = [o.token_ids for o in LLM(big_vocab, dtype=dtype, head_screen=False).generate(prompts, params)]
    screened = LLM(big_vocab, dtype=dtype)
    assert [o.token_ids for o in screened.generate(prompts, params)] == want
    assert [o.token_ids for o in screened.generate(prompts[:1], params[:1])] == want[:1]  # alone: the same draw
    screen = screened.runner.target.screen
    assert screen is None or screen.calls > 0


def test_requests_that_read_more_than_the_argmax_take_the_whole_head(big_vocab: Path) -> None:
    llm = LLM(big_vocab, dtype="float32")
    screen = llm.runner.target.screen
    others = [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4, seed=1),
        SamplingParams(temperature=0, max_tokens=4, logprobs=2),
        SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.3),
        SamplingParams(temperature=0.7, top_k=20, max_tokens=4, seed=2),
    ]
    for params in others:
        assert not params.argmax_only and not params.gumbel_sampled
        before = screen.calls
        llm.generate([[5, 6, 7]], params)
        assert screen.calls == before, params
    mixed = llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(temperature=0, max_tokens=4), others[1]])
    assert screen.calls == 0 and len(mixed[1].logprobs) == 4
    plain = LLM(big_vocab, dtype="float32", head_screen=False).generate([[5, 6, 7]], others[1])[0]
    assert llm.generate([[5, 6, 7]], others[1])[0].logprobs == plain.logprobs
    assert SamplingParams(temperature=0).argmax_only and SamplingParams(temperature=0.7, seed=3).gumbel_sampled


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_screened_gumbel_draws_are_the_whole_heads(dtype: torch.dtype) -> None:
    """Perturbed by the same noise, the screened scores have the whole head's argmax, draw by draw."""
    w = _head(3000, 96, dtype, seed=11)
    screen = HeadScreen(w)
    gen = torch.Generator().manual_seed(0)
    for seed in range(8):
        x = _rows(3, 96, dtype, seed, w)
        draw = GumbelDraw(torch.tensor([0.7, 1.0, 1.6]), gumbel_noise([None] * 3, gen, 3000))
        whole = draw.apply(_whole(x, w))
        got = screen.logits(x, draw)
        assert torch.equal(got.argmax(-1), whole.argmax(-1))
    assert screen.candidates < screen.calls * 3000 // 4  # it screened most rows out


def test_gumbel_draws_follow_the_softmax() -> None:
    """argmax(l / T + G) against float64 softmax(l / T): each of the likeliest tokens' frequency
    within 4.5 standard errors over 20,000 draws (screened head, float32)."""
    w = _head(2000, 64, torch.float32, seed=3)
    screen = HeadScreen(w)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(9)) * 8
    temperature = 0.8
    p = torch.softmax(_whole(x, w).double()[0] / temperature, -1)
    gen = torch.Generator().manual_seed(1)
    draws = 20_000
    counts = torch.zeros(2000, dtype=torch.float64)
    for _ in range(draws // 500):
        noise = gumbel_noise([None] * 500, gen, 2000)
        rows = x.expand(500, 64).contiguous()
        ids = torch.cat(
            [
                screen.logits(rows[i : i + 4], GumbelDraw(torch.full((4,), temperature), noise[i : i + 4])).argmax(-1)
                for i in range(0, 500, 4)
            ]
        )
        counts += torch.bincount(ids, minlength=2000).double()
    top = p.topk(5).indices
    assert float(p[top].sum()) > 0.3  # a distribution with a head and a tail
    err = (p[top] * (1 - p[top]) / draws).sqrt()
    assert ((counts[top] / draws - p[top]).abs() <= 4.5 * err).all()
    assert screen.flat == 0 and screen.candidates < screen.calls * 2000 // 8  # the screen decided


def test_a_flat_head_takes_the_whole_head_and_stops_paying() -> None:
    """Rows that all tie (an untrained head, say): every row is a candidate, so the whole head runs
    (the argmax still the first index) and, past 32 rows, the screen says it does not pay."""
    w = torch.randn(1, 64).repeat(2000, 1).contiguous()
    screen = HeadScreen(w)
    x = torch.randn(1, 64)
    for _ in range(40):
        got = screen.logits(x)
        assert int(got.argmax()) == 0 and torch.equal(got, _whole(x, w))
    assert screen.flat == 40 and not screen.pays


def test_decode_profile_counts_the_bytes_a_greedy_row_reads(big_vocab: Path) -> None:
    """`benchmarks.decode_profile` sets each part's time against the bytes it reads: a screened
    or int8 head reads its int8 rows and their float32 scales, a plain one its bf16 weight."""
    from benchmarks.decode_profile import head_bytes

    def target(**kw: object) -> object:
        return LLM(big_vocab, dtype="bfloat16", **kw).runner.target  # type: ignore[arg-type]

    plain = target(head_screen=False)
    rows, k = plain.lm_head.shape
    assert head_bytes(plain) == rows * k * 2
    screened = target()  # no screen under avx2 on a native-bf16 CPU (oneDNN runs bf16 heads there)
    assert head_bytes(screened) == (rows * k + rows * 4 if screened.screen is not None else rows * k * 2)
    assert head_bytes(target(head_quant="int8", head_screen=False)) == rows * k + rows * 4
