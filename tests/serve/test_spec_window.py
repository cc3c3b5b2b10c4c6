"""Per-request draft windows: the depth counts, the goodput plan against brute force, probes."""

import itertools
import math
from pathlib import Path

import pytest
import torch

from serve import LLM, SamplingParams
from serve.spec_cost import RecentMedian, StepCostTable
from serve.spec_decode import SpecController
from serve.spec_window import DepthCounts, StepCost, WindowPlanner, best_windows, is_lookup_key, linear_cost, source_key


def expected_tokens(rates: list[float], k: int) -> float:
    """1 + sum over depths j <= k of the probability that drafts 1..j all hold."""
    return 1.0 + sum(math.prod(rates[: j + 1]) for j in range(k))


def goodput(rates: list[list[float]], windows: tuple[int, ...] | list[int], cost: StepCost, batch: int) -> float:
    """Tokens per unit of step cost for a window vector (a plain step of the batch costs 1)."""
    tokens = sum(expected_tokens(r, k) for r, k in zip(rates, windows)) + batch - len(rates)
    return tokens / (cost(sum(windows) / batch) if any(windows) else 1.0)


def test_depth_counts_record_trials_up_to_the_first_rejection() -> None:
    counts = DepthCounts.empty(4)
    counts.observe(proposed=4, accepted=2, decay=1.0)  # depths 1, 2 held, 3 failed, 4 never judged
    assert counts.trials == [1, 1, 1, 0] and counts.successes == [1, 1, 0, 0]
    counts.observe(proposed=2, accepted=2, decay=0.5)  # a window of 2, both held
    assert counts.trials == [1.5, 1.5, 0.5, 0] and counts.successes == [1.5, 1.5, 0, 0]
    assert counts.rates([0.5] * 4, weight=1.0) == pytest.approx([0.8, 0.8, 1 / 3, 0.5])


def random_cost(g: torch.Generator, batch: int, k: int) -> StepCost:
    """A nondecreasing step cost over n = 1..batch*k drafted tokens with random (often flat) steps."""
    steps = torch.rand(batch * k, generator=g) * (torch.rand(batch * k, generator=g) < 0.5)
    table = (1.0 + float(torch.rand(1, generator=g)) + torch.cumsum(steps * 0.4, 0)).tolist()
    return lambda window: table[round(window * batch) - 1]


@pytest.mark.parametrize("seed", range(30))
def test_best_windows_match_brute_force(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    planned, k = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
    batch = planned + (seed % 3 == 2)  # one decoding request that may not speculate
    rates = torch.rand(planned, k, generator=g).pow(0.5).tolist()
    if seed % 3 == 0:
        cost = random_cost(g, batch, k)
    else:
        cost = linear_cost(float(torch.rand(1, generator=g)) * 0.6, float(torch.rand(1, generator=g)) * 0.8)
    best = max(goodput(rates, w, cost, batch) for w in itertools.product(range(k + 1), repeat=planned))
    assert goodput(rates, best_windows(rates, cost, batch), cost, batch) == pytest.approx(best, rel=1e-12)


def test_best_windows_edges() -> None:
    assert best_windows([], linear_cost(0.2)) == []
    assert best_windows([[1.0, 1.0, 1.0]], linear_cost(0.0)) == [3]  # free drafts that always hold: all
    assert best_windows([[0.0, 1.0]], linear_cost(0.1)) == [0]  # a draft that never holds: plain decoding
    # one request that follows its draft and one that does not, in the same batch
    assert best_windows([[0.9, 0.9, 0.9, 0.9], [0.05, 0.5, 0.5, 0.5]], linear_cost(0.2)) == [4, 0]


def test_a_fixed_cost_keeps_windows_long_or_turns_speculation_off() -> None:
    rates = [[0.8, 0.8, 0.8, 0.8]] * 2
    assert best_windows(rates, linear_cost(0.3)) == [3, 3]
    assert best_windows(rates, linear_cost(0.3, fixed=0.5)) == [4, 4]  # paying f anyway, draft deeper
    assert best_windows(rates, linear_cost(0.3, fixed=3.0)) == [0, 0]  # no window repays the fixed part


def test_a_cost_flat_after_the_first_token_takes_the_full_window() -> None:
    """Steep from one drafted token to two and flat after (as when verification leaves the
    single-token kernels): every window but the full one costs nearly as much, so take it all;
    the line through the same points would stop at three."""
    measured = {1: 1.22, 2: 1.68, 3: 1.74, 4: 1.87}
    table = StepCostTable()
    for window, cost in measured.items():
        table.record(window, cost)
    rates = [[0.7, 0.7, 0.7, 0.7]]
    assert best_windows(rates, lambda w: table.cost(w, 1.0) or 1.0) == [4]
    slope, intercept = 0.201, 1.125  # least squares through the four points
    assert best_windows(rates, lambda w: intercept + slope * w) == [3]


def test_step_cost_table_interpolates_measured_bins_and_is_optimistic_elsewhere() -> None:
    table = StepCostTable(bin_width=0.5, min_samples=1)
    assert table.cost(1.0, plain_seconds=2.0) is None
    table.record(1.0, 3.0)
    table.record(3.0, 3.6)
    table.record(1.1, 3.4)  # same bin as 1.0
    assert [c for point in table.points() for c in point] == pytest.approx([1.05, 3.2, 3.0, 3.6])
    assert table.cost(0.5, 2.0) == pytest.approx((2.0 + (3.2 - 2.0) * 0.5 / 1.05) / 2.0)  # from the plain step
    assert table.cost(2.0, 2.0) == pytest.approx((3.2 + 0.4 * 0.95 / 1.95) / 2.0)
    assert table.cost(4.0, 2.0) == pytest.approx(1.8)  # beyond the widest bin: flat (a lower bound)
    table.record(2.0, 3.0)  # a sample cheaper than the window below it
    assert [s for _, s in table.curve()] == pytest.approx([3.1, 3.1, 3.6])  # pooled: never decreasing


def test_a_stalled_step_does_not_make_its_window_look_dear() -> None:
    """One step preempted to 5x its time moves a mean by a third and the median not at all;
    the plan would otherwise leave that window and never sample it again to correct it."""
    table = StepCostTable()
    for seconds in (2.0, 2.1, 1.9, 10.0, 2.0, 2.05, 1.95):
        table.record(4.0, seconds)
    for _ in range(3):
        table.record(3.0, 1.9)
    assert table.cost(4.0, 1.0) == pytest.approx(2.0)
    table.record(5.0, 2.0)  # one sample is not a measurement yet: reads as the widest measured bin
    assert table.cost(5.0, 1.0) == pytest.approx(2.0)
    recent = RecentMedian(size=3)
    for value in (5.0, 1.0, 2.0, 3.0):
        recent.add(value)
    assert list(recent.samples) == [1.0, 2.0, 3.0] and recent.value == 2.0


def test_a_window_left_alone_is_measured_afresh() -> None:
    """A bin the plan stopped choosing is emptied after `stale_after` steps, so it reads as
    cheap as its neighbours allow and gets tried again under the host's current speed."""
    table = StepCostTable(min_samples=1, stale_after=4)
    table.record(4.0, 3.0)  # dear once
    for _ in range(4):
        table.record(3.0, 2.0)
    assert table.cost(4.0, 1.0) == pytest.approx(3.0)
    table.record(3.0, 2.0)
    assert table.cost(4.0, 1.0) == pytest.approx(2.0) and 8 not in table.seconds


def test_controller_step_cost_reads_the_bucket_table() -> None:
    ctl = SpecController(k=4, min_samples=1, ema=1.0)
    assert ctl.step_cost(16)(2.0) == 1.0  # nothing timed: drafting looks free
    ctl.record_plain(16, seconds=1.0)
    for window, seconds in ((1, 2.0), (2, 2.6), (4, 2.7)):
        ctl.record_spec(16, seconds=seconds, proposed=16 * window, accepted=0)
    cost = ctl.step_cost(16)
    assert [cost(w) for w in (1, 2, 3, 4)] == pytest.approx([2.0, 2.6, 2.65, 2.7])
    assert ctl.step_cost(31)(4) == pytest.approx(2.7) and ctl.step_cost(1)(4) == 1.0  # bucket 16-31; batch 1 apart


def test_planner_turns_a_failing_request_off_and_probes_it() -> None:
    planner = WindowPlanner(k=4, probe_first=2, probe_every=8)
    assert planner.plan(["a", "b"], linear_cost(0.2)) == {"a": 4, "b": 4}  # nothing seen: optimistic
    for _ in range(6):
        planner.observe("a", 4, 4)
        planner.observe("b", 4, 0)
    windows = [planner.plan(["a", "b"], linear_cost(0.2)) for _ in range(16)]
    assert [w["a"] for w in windows] == [4] * 16
    # off, then one-token probes after 2, 4 and then every 8 idle steps
    assert [w["b"] for w in windows] == [0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0]
    for _ in range(3):
        planner.observe("b", 4, 4)  # its draft follows again: back on, and the backoff starts over
    assert planner.plan(["b"], linear_cost(0.2))["b"] > 0 and planner.interval["b"] == 2
    planner.forget("b")
    assert "b" not in planner.requests and "b" not in planner.idle and "b" not in planner.interval
    assert planner.plan(["c"], linear_cost(0.2))["c"] > 0  # a new request starts from the engine's record (half held)


def test_planner_probes_a_plain_step_only_where_the_probe_pays() -> None:
    """On a step no request speculates in, due probes run only if, at the engine's acceptance,
    they beat plain decoding; otherwise they wait and ride on the next speculating step."""
    planner = WindowPlanner(k=4, probe_first=2, probe_every=8)
    for rid in "abcd":
        for _ in range(6):
            planner.observe(rid, 4, 0)  # every draft fails: plain
    for _ in range(8):
        planner.observe("e", 1, 1)  # the engine's record: first tokens mostly accepted
    rate = planner.engine.rates([1.0] * 4, 1.0)[0]
    dear = [planner.plan(list("abcd"), linear_cost(1.0), 4) for _ in range(2)]  # a draft token: a step
    assert all(w == dict.fromkeys("abcd", 0) for w in dear) and planner.idle["a"] == 2  # due, not run
    cheap = planner.plan(list("abcd"), linear_cost(0.3), 4)  # probes pay at acceptance `rate`
    assert rate > 0.3 and cheap == dict.fromkeys("abcd", 1) and planner.idle["a"] == 0
    assert planner.probes_that_pay(4, 1, linear_cost(1.0), 4) == 0
    # a probe costs 0.2 / 4 of a step for rate / 4 more tokens: each one pays
    assert planner.probes_that_pay(4, 1, linear_cost(0.2), 4) == 4


def test_controller_plan_explores_then_plans_per_request() -> None:
    ctl = SpecController(k=4, min_samples=1, probe_every=1000)
    assert ctl.plan(["a", "b"], 2, timed=False) == {"a": 0, "b": 0}  # beside a prefill: no exploring
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
    ctl.windows.probe_first = ctl.windows.probe_every = 1000  # the engine's probes alone
    ctl.record_spec(1, seconds=3.0, proposed=4, accepted=0)  # 3x the cost of a plain step
    ctl.record_plain(1, seconds=1.0)
    for _ in range(8):
        ctl.observe("a", 4, 0)
    windows = [ctl.plan(["a"], 1)["a"] for _ in range(8)]
    assert windows == [0, 0, 0, 1, 1, 0, 0, 1]  # a probe of 2 steps, 1 token each, after 4 steps


def test_controller_backs_off_probes_of_a_losing_draft_and_resets_when_it_wins() -> None:
    ctl = SpecController(k=4, min_samples=1, probe_every=4, max_probe_every=16, probe_steps=2)
    ctl.windows.probe_first = ctl.windows.probe_every = 1000  # the engine's probes alone
    ctl.record_spec(1, seconds=3.0, proposed=4, accepted=0)
    ctl.record_plain(1, seconds=1.0)
    for _ in range(8):
        ctl.observe("a", 4, 0)
    windows = [ctl.plan(["a"], 1)["a"] for _ in range(60)]
    starts = [i + 1 for i, w in enumerate(windows) if w and not (i and windows[i - 1])]
    assert starts == [4, 8, 16, 32, 48]  # intervals 4, 8, 16, then capped at 16
    for _ in range(20):  # the draft now follows the text and a speculative step is cheap
        ctl.observe("a", 4, 4)
        ctl.record_spec(1, seconds=1.1, proposed=4, accepted=4)
    assert ctl.plan(["a"], 1)["a"] > 0 and ctl.timings[1].spec_interval == 4


def test_controller_prices_lookup_steps_apart_from_draft_model_steps() -> None:
    """A step of lookups alone runs no draft forward: its own table prices it; each table
    stands in for the other until it has points; a plan of lookup keys only reads the lookup
    table."""
    ctl = SpecController(k=4, min_samples=1, ema=1.0)
    ctl.record_plain(1, seconds=1.0)
    ctl.record_spec(1, seconds=3.0, proposed=1, accepted=1)  # the draft model: 3 plain steps at window 1
    assert ctl.step_cost(1, lookup_only=True)(1) == pytest.approx(3.0)  # no lookup points yet
    ctl.record_spec(1, seconds=1.2, proposed=1, accepted=1, lookup_only=True)
    assert ctl.step_cost(1, lookup_only=True)(1) == pytest.approx(1.2)
    assert ctl.step_cost(1)(1) == pytest.approx(3.0)
    key = source_key("a", True)
    assert is_lookup_key(key) and not is_lookup_key(source_key("a", False))
    for _ in range(8):  # both proposers: the first token accepted, the second not
        ctl.observe(key, 2, 1)
        ctl.observe("a", 2, 1)
    # about 2 tokens per step: pays at 1.2 plain steps (lookup), not at 3 (the draft model)
    assert ctl.plan([key], 1)[key] >= 1 and ctl.plan(["a"], 1)["a"] == 0
    ctl.forget("a")
    assert not ctl.windows.requests
