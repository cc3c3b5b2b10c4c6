"""Prompt lookup: the n-gram search against a brute-force loop, and the engine drafting with it
(alone and beside a draft model) keeps greedy outputs and sampled distributions exact."""

import random
from pathlib import Path

import pytest
import torch

from serve import LLM, SamplingParams
from serve.args import EngineArgs
from serve.prompt_lookup import lookup
from serve.sampler import process_logits
from serve.sequence import DraftSources
from serve.spec_decode import rejection_sample
from serve.spec_window import is_lookup_key, source_key
from tests.serve.test_engine import finish, random_prompts
from tests.serve.test_sampling import _chi2_ok


def brute_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition spelled out: longest suffix first, latest earlier occurrence, and the copy
    continues through the tokens it has already proposed."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                extended = list(tokens)
                for i in range(start + n, start + n + k):
                    extended.append(extended[i])
                return extended[len(tokens) :] if k else []
    return []


@pytest.mark.parametrize("seed", range(4))
def test_lookup_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(400):
        tokens = [rng.randrange(3 + seed) for _ in range(rng.randrange(0, 40))]
        k, min_n = rng.randrange(0, 6), rng.randrange(1, 4)
        max_n = min_n + rng.randrange(0, 4)
        assert lookup(tokens, k, min_n, max_n) == brute_lookup(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)


def test_lookup_cases() -> None:
    assert lookup([1, 2, 3, 9, 1, 2, 3], 2, 2, 4) == [9, 1]
    assert lookup([1, 2, 5, 1, 2, 7, 1, 2], 3, 2, 4) == [7, 1, 2]  # latest occurrence
    assert lookup([4, 2, 5, 1, 2, 7, 4, 2], 1, 1, 2) == [5]  # the longer suffix [4, 2] wins over [2]
    assert lookup([7, 8, 7, 8], 5, 2, 2) == [7, 8, 7, 8, 7]  # a short loop fills the window
    assert lookup([1, 2, 3, 4], 3, 2, 4) == []
    assert lookup([1, 1], 3, 2, 4) == []


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that end by repeating their opening, so lookups find something from the first step."""
    return [p + p[: 2 + i % 4] for i, p in enumerate(random_prompts(n, seed, lo=6, hi=20))]


def check_draft_cache(llm: LLM, alone: LLM) -> None:
    """Make every draft proposal assert that its first token is the draft's greedy choice on the
    whole context, as the draft served alone computes it: a draft cache that skipped the tokens
    of looked-up steps would propose from a context with holes (outputs would not show it)."""
    propose = llm.runner._propose_greedy
    once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def checked(seqs, rows, logits, counts):  # noqa: ANN001, ANN202
        proposal = propose(seqs, rows, logits, counts)
        for j, seq in enumerate(seqs):
            assert int(proposal.tokens[j, 0]) == alone.generate([list(seq.token_ids)], once)[0].token_ids[0]
        return proposal

    llm.runner._propose_greedy = checked


# the lookup tests' engine: float32, fixed windows of 3, lookups of up to 3 tokens
LOOKUP_ENGINE = {"dtype": "float32", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive_speculation": False}


@pytest.mark.parametrize("with_draft", [False, True])
def test_greedy_outputs_unchanged_with_lookup(spec_pair: tuple[Path, Path], with_draft: bool) -> None:
    target, draft = spec_pair
    prompts = repetitive_prompts(6, seed=4) + random_prompts(2, seed=5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in LLM(target, dtype="float32").generate(prompts, params)]
    llm = LLM(
        target, draft if with_draft else None, **LOOKUP_ENGINE, draft_head_quant="none", block_size=4, num_kv_blocks=60
    )
    if with_draft:
        check_draft_cache(llm, LLM(draft, dtype="float32", draft_head_quant="none"))
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    st = llm.stats
    assert st.lookup_proposed > 0
    assert st.lookup_accepted > 0 or with_draft  # a random target copies rarely; the draft takes the other steps
    assert (st.spec_proposed > st.lookup_proposed) == with_draft  # the draft model drafted where lookups failed
    finish(llm)


def test_greedy_and_sampled_rows_share_a_batch(spec_pair: tuple[Path, Path]) -> None:
    """Rows drafted by lookup (one-hot q) and by the draft model, greedy and sampled, in one
    batch: greedy rows stay exact. A prompt holding every id makes each step's lookup succeed
    (min 1); short random prompts rarely find one, so the draft model drafts for them."""
    target, draft = spec_pair
    ids = list(range(3, 300))
    every = [random.Random(i).sample(ids, len(ids)) for i in range(2)]
    prompts = [every[0], *random_prompts(2, seed=6, hi=12), every[1]]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, seed=3)
    plain = [o.token_ids for o in LLM(target, dtype="float32").generate(prompts, greedy)]
    llm = LLM(target, draft, **LOOKUP_ENGINE, prompt_lookup_min=1, kv_cache_memory_gb=0.05)
    for order in ((greedy, sampled), (sampled, greedy)):
        outs = llm.generate(prompts, [*order, *order])
        kept = [i for i in range(4) if [*order, *order][i] is greedy]
        assert [outs[i].token_ids for i in kept] == [plain[i] for i in kept]
        assert all(len(o.token_ids) == 16 for o in outs)
    st = llm.stats
    assert st.lookup_proposed > 0 and st.spec_proposed > st.lookup_proposed
    finish(llm)


def test_a_looked_up_token_keeps_the_target_distribution() -> None:
    """A lookup's q is one-hot: the emitted token must still be distributed as p."""
    gen = torch.Generator().manual_seed(0)
    n, vocab, k = 60_000, 16, 2
    p = process_logits(
        torch.randn(k + 1, vocab, generator=gen) * 1.5, torch.ones(k + 1), torch.full((k + 1,), -1), torch.ones(k + 1)
    )
    drafts = torch.tensor([[int(p[0].argmax()), 3]]).expand(n, k)
    q = torch.zeros(n, k, vocab).scatter_(2, drafts[..., None], 1.0)
    result = rejection_sample(drafts, q, p.expand(n, k + 1, vocab), torch.full((n,), k), [None] * n, gen)
    assert _chi2_ok(result.tokens[:, 0], p[0]) > 1e-3
    reached = result.num_accepted >= 1
    assert _chi2_ok(result.tokens[reached, 1], p[1]) > 1e-3


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"prompt_lookup_max": -1}, "prompt_lookup_max"),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"prompt_lookup_max": 2, "prompt_lookup_min": 3}, "prompt_lookup_min=3 exceeds"),
    ],
)
def test_bad_lookup_options_named(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        EngineArgs(**kwargs)


def test_server_flags_reach_the_engine_options() -> None:
    from serve.api.cli import build_parser

    ns = build_parser().parse_args(["model", "--prompt-lookup-max", "3", "--prompt-lookup-min", "1"])
    args = EngineArgs.from_namespace(ns)
    assert (args.prompt_lookup_max, args.prompt_lookup_min) == (3, 1)
    assert EngineArgs.from_namespace(build_parser().parse_args(["model"])).prompt_lookup_max == 0


def test_lookup_and_draft_keep_separate_records_and_cost_tables(spec_pair: tuple[Path, Path]) -> None:
    """Drafts by lookup are counted under the request's lookup key and timed in the lookup
    table; the draft model's under the request id and the model table; the windows the engine
    plans are asked for under the key of the proposer that will draft."""
    target, draft = spec_pair
    prompts = repetitive_prompts(3, seed=4) + random_prompts(2, seed=5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # one request a step: each step is a lookup-only or a model step
    llm = LLM(target, draft, **LOOKUP_ENGINE, block_size=4, num_kv_blocks=60, max_num_seqs=1)
    observed: list[tuple[str, bool]] = []
    observe, looks_up = llm.spec.observe, llm.runner.looks_up
    planned: dict[str, bool] = {}

    def record(key: str, proposed: int, accepted: int) -> None:
        observed.append((key, key in planned and planned[key]))
        observe(key, proposed, accepted)

    def routed(seq):  # noqa: ANN001, ANN202
        found = looks_up(seq)
        planned[source_key(seq.request_id, found)] = found
        return found

    llm.spec.observe, llm.runner.looks_up = record, routed  # type: ignore[method-assign]
    llm.generate(prompts, params)
    lookup_keys = [k for k, _ in observed if is_lookup_key(k)]
    model_keys = [k for k, _ in observed if not is_lookup_key(k)]
    assert lookup_keys and model_keys
    assert all(found == is_lookup_key(k) for k, found in observed if k in planned)  # planned as drafted
    tables = llm.spec.timings.values()
    assert any(t.lookup_costs.records for t in tables) and any(t.costs.records for t in tables)
    assert not llm.spec.windows.requests  # both records of every finished request forgotten
    finish(llm)


def test_a_lookup_that_missed_is_tried_again_after_some_model_drafts() -> None:
    """A lookup record stuck below the model's (one early miss) must not lock lookups out of the
    request: after `retry` verifications by the draft model a found lookup drafts again."""
    sources = DraftSources(retry=3)
    assert sources.prefers_lookup()  # nothing measured: lookup first
    sources.observe(True, 0)  # the lookup missed
    sources.observe(False, 1)
    assert not sources.prefers_lookup()
    sources.observe(False, 1)
    sources.observe(False, 1)
    assert sources.prefers_lookup()  # three model drafts since: retry the lookup
    sources.observe(True, 4)  # it follows the text now: record 0.3 * 4 = 1.2 against the model's 1
    assert sources.since_lookup == 0 and sources.prefers_lookup()
    sources.observe(True, 0)
    sources.observe(True, 0)
    sources.observe(True, 0)
    assert not sources.prefers_lookup()  # three misses: 1.2 * 0.7^3 = 0.41, below the model's 1
