"""Per-request draft windows: the depth counts, the goodput plan against brute force, probes."""

import itertools
import math
from pathlib import Path

import pytest
import torch

from serve import LLM, SamplingParams
from serve.spec_decode import SpecController
from serve.spec_window import DepthCounts, WindowPlanner, best_windows


def expected_tokens(rates: list[float], k: int) -> float:
    """1 + sum over depths j <= k of the probability that drafts 1..j all hold."""
    return 1.0 + sum(math.prod(rates[: j + 1]) for j in range(k))


def goodput(rates: list[list[float]], windows: tuple[int, ...] | list[int], c: float, f: float = 0.0) -> float:
    """Tokens per unit of step cost for a window vector (a plain step of the batch costs 1)."""
    tokens = sum(expected_tokens(r, k) for r, k in zip(rates, windows))
    return tokens / (1.0 + (f if any(windows) else 0.0) + c * sum(windows) / len(rates))


def test_depth_counts_record_trials_up_to_the_first_rejection() -> None:
    counts = DepthCounts.empty(4)
    counts.observe(proposed=4, accepted=2, decay=1.0)  # depths 1, 2 held, 3 failed, 4 never judged
    assert counts.trials == [1, 1, 1, 0] and counts.successes == [1, 1, 0, 0]
    counts.observe(proposed=2, accepted=2, decay=0.5)  # a window of 2, both held
    assert counts.trials == [1.5, 1.5, 0.5, 0] and counts.successes == [1.5, 1.5, 0, 0]
    assert counts.rates([0.5] * 4, weight=1.0) == pytest.approx([0.8, 0.8, 1 / 3, 0.5])


@pytest.mark.parametrize("seed", range(20))
def test_best_windows_match_brute_force(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    batch, k = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
    rates = torch.rand(batch, k, generator=g).pow(0.5).tolist()
    c = float(torch.rand(1, generator=g)) * 0.6
    f = float(torch.rand(1, generator=g)) * 0.8 if seed % 2 else 0.0
    best = max(goodput(rates, w, c, f) for w in itertools.product(range(k + 1), repeat=batch))
    assert goodput(rates, best_windows(rates, c, f), c, f) == pytest.approx(best, rel=1e-12)


def test_best_windows_edges() -> None:
    assert best_windows([], 0.2) == []
    assert best_windows([[1.0, 1.0, 1.0]], 0.0) == [3]  # free drafts that always hold: all of them
    assert best_windows([[0.0, 1.0]], 0.1) == [0]  # a draft that never holds: plain decoding
    # one request that follows its draft and one that does not, in the same batch
    assert best_windows([[0.9, 0.9, 0.9, 0.9], [0.05, 0.5, 0.5, 0.5]], 0.2) == [4, 0]


def test_a_fixed_cost_keeps_windows_long_or_turns_speculation_off() -> None:
    rates = [[0.8, 0.8, 0.8, 0.8]] * 2
    assert best_windows(rates, 0.3) == [3, 3]
    assert best_windows(rates, 0.3, fixed_cost=0.5) == [4, 4]  # paying f anyway, draft deeper
    assert best_windows(rates, 0.3, fixed_cost=3.0) == [0, 0]  # no window repays the fixed part


def test_controller_fits_fixed_and_per_token_step_costs() -> None:
    ctl = SpecController(k=4, min_samples=1, ema=1.0)
    ctl.record_plain(16, seconds=1.0)
    for window in (1, 2, 4, 1, 3, 4):  # steps cost 1 + 1.5 + 0.25 * window plain steps
        ctl.record_spec(16, seconds=2.5 + 0.25 * window, proposed=16 * window, accepted=0)
    fixed, per_token = ctl.step_costs(16)
    assert fixed == pytest.approx(1.5) and per_token == pytest.approx(0.25)
    same = SpecController(k=4, min_samples=1)
    same.record_plain(1, seconds=1.0)
    for _ in range(3):  # windows never varied: the chord from the plain step
        same.record_spec(1, seconds=2.0, proposed=4, accepted=0)
    assert same.step_costs(1) == pytest.approx((0.0, 0.25))


def test_planner_turns_a_failing_request_off_and_probes_it() -> None:
    planner = WindowPlanner(k=4, probe_every=3)
    assert planner.plan(["a", "b"], 0.2) == {"a": 4, "b": 4}  # nothing seen: optimistic
    for _ in range(6):
        planner.observe("a", 4, 4)
        planner.observe("b", 4, 0)
    windows = [planner.plan(["a", "b"], 0.2) for _ in range(4)]
    assert [w["a"] for w in windows] == [4, 4, 4, 4]
    assert [w["b"] for w in windows] == [0, 0, 1, 0]  # off, then a one-token probe once in 3 steps
    planner.forget("b")
    assert "b" not in planner.requests and "b" not in planner.idle
    assert planner.plan(["c"], 0.2)["c"] > 0  # a new request starts from the engine's record (half held)


def test_controller_plan_explores_then_plans_per_request() -> None:
    ctl = SpecController(k=4, min_samples=1, probe_every=1000)
    assert ctl.plan(["a", "b"], 2) == {"a": 4, "b": 4}  # explore speculation
    ctl.record_spec(2, seconds=1.4, proposed=8, accepted=4)
    assert ctl.plan(["a", "b"], 2) == {"a": 0, "b": 0}  # then plain
    ctl.record_plain(2, seconds=1.0)
    assert ctl.cost_ratio(2) == pytest.approx(0.1)  # 0.4 extra over 4 drafted tokens per sequence
    for _ in range(8):
        ctl.observe("a", 4, 4)
        ctl.observe("b", 4, 0)
    assert ctl.plan(["a", "b"], 2) == {"a": 4, "b": 0}
    assert SpecController(k=3, adaptive=False).plan(["a"], 1) == {"a": 3}


def test_per_request_windows_keep_greedy_outputs(spec_pair: tuple[Path, Path]) -> None:
    """Requests with different windows (down to 0) in one batch emit what the target alone does."""
    target, draft = spec_pair
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 17, 33, 9)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = [o.token_ids for o in LLM(target, dtype="float32").generate(prompts, params)]
    llm = LLM(target, draft, dtype="float32", num_speculative_tokens=4, block_size=4)
    llm.spec.min_samples, llm.spec.ema = 1, 0.0  # fixed step costs: a drafted token costs 0.05 of a step
    for size in (1, 2, 4):
        llm.spec.record_spec(size, seconds=1.2, proposed=4 * size, accepted=0)
        llm.spec.record_plain(size, seconds=1.0)
    for _ in range(8):  # the second request's record says its draft fails: it decodes plainly
        llm.spec.observe("req-1", 4, 0)
    scheduled: list[list[int]] = []
    schedule = llm.scheduler.schedule

    def record(num_spec_tokens: int):  # noqa: ANN202
        batch = schedule(num_spec_tokens)
        scheduled.append(list(batch.num_spec_tokens))
        return batch

    llm.scheduler.schedule = record  # type: ignore[method-assign]
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    assert any(w[1] == 0 and w[0] > 0 for w in scheduled if len(w) == 4)  # request 1 plain, request 0 drafting
    assert not llm.spec.windows.requests  # finished requests were forgotten
    assert not llm.has_unfinished_requests()
    llm.block_manager.check_no_leaks()


def test_controller_probes_a_losing_draft_with_a_short_window() -> None:
    ctl = SpecController(k=4, min_samples=1, probe_every=4, probe_steps=2)
    ctl.record_spec(1, seconds=3.0, proposed=4, accepted=0)  # 3x the cost of a plain step
    ctl.record_plain(1, seconds=1.0)
    for _ in range(8):
        ctl.observe("a", 4, 0)
    windows = [ctl.plan(["a"], 1)["a"] for _ in range(8)]
    assert windows == [0, 0, 0, 1, 1, 0, 0, 1]  # every 4th step a probe of 2 steps, 1 token each
