"""warsha.train_overhead compares like with like: the trainer and the bare loop do the same work.

For every stage's case the two loops start from identical weights, see identical batches and use
the same loss, so their loss curves must agree; a case whose loops diverged would report an
overhead that is really a different computation. The allocator comparison's aggregation is
checked against rows whose answer is known.
"""

from __future__ import annotations

import argparse

import pytest

from warsha import train_cases, train_overhead


@pytest.mark.parametrize("name", list(train_cases.CASES))
def test_trainer_and_bare_loop_train_identically(name: str) -> None:
    args = argparse.Namespace(steps=1)
    rows = train_overhead.run_case(train_cases.CASES[name](args), args, name)
    ours, bare = rows["trainer"], rows["bare"]
    assert len(rows["losses"]["trainer"]) == len(rows["losses"]["bare"]) == 2
    # step 0 from identical weights: equal; step 1 after one identical update: equal to float32 noise
    assert rows["losses"]["trainer"] == pytest.approx(rows["losses"]["bare"], rel=1e-4)
    assert ours["tokens_per_s"] > 0 and bare["tokens_per_s"] > 0
    assert 0.0 <= ours["sys_share"] <= 1.0


def test_allocator_row_weights_rounds_by_time() -> None:
    def run(tok_s: float, wall: float, user: float, sys_s: float) -> dict:
        return {"bootstrap": {"trainer": {"tokens_per_s": tok_s, "wall_s": wall, "user_s": user, "sys_s": sys_s}}}

    runs = {
        "system": [run(100.0, 10.0, 15.0, 5.0), run(50.0, 20.0, 30.0, 10.0)],  # 2000 tokens in 30 s
        "glibc-tuned": [run(200.0, 10.0, 19.0, 1.0)],  # 2000 tokens in 10 s
    }
    row = train_overhead.allocator_row(runs, "bootstrap")
    assert row["system"]["tokens_per_s"] == pytest.approx(2000 / 30)
    assert row["system"]["sys_share"] == pytest.approx(15 / 60)
    assert row["glibc-tuned"]["sys_per_user"] == pytest.approx(1 / 19)
    assert row["glibc-tuned"]["speedup"] == pytest.approx(200 / (2000 / 30))
    assert row["system"]["speedup"] == pytest.approx(1.0)


def test_children_start_without_the_parents_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc_minimal.so.4 /opt/libother.so")
    monkeypatch.setenv("MALLOC_TOP_PAD_", "1")
    monkeypatch.setenv("WARSHA_ALLOCATOR_REEXEC", "1")
    env = train_overhead.child_env("system")
    assert env["WARSHA_ALLOCATOR"] == "system" and env["LD_PRELOAD"] == "/opt/libother.so"
    assert "MALLOC_TOP_PAD_" not in env and "WARSHA_ALLOCATOR_REEXEC" not in env
