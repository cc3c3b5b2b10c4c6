"""The chain-rule teacher's second level (``tokenizer_ext.chain_teacher``) against a float64 loop
that forms each row's conditional distribution piece by piece, and wired into the fit."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from tests.tokenizer_ext.conftest import make_ctx
from tokenizer_ext import chain_teacher, embed
from tokenizer_ext.stages import EmbedParams
from warsha.training import TrainParams

SOURCES = [[1, 2], [1, 2, 5], [1, 3], [4, 2], [4, 6, 7], [1, 7], [0]]  # the last: no second id


def _reference(new: torch.Tensor, nxt_logit: torch.Tensor, nxt: list[int], teacher: torch.Tensor) -> float:
    """The loss row by row: the model's distribution over ``nxt`` alone and the pieces starting
    with it, the base's ``p(second | nxt)`` per group, the rest to ``nxt`` alone."""
    total = 0.0
    groups = chain_teacher.chain_groups(SOURCES, 10)
    keys = list(zip(groups.group_first.tolist(), groups.group_second.tolist()))
    for r, b in enumerate(nxt):
        members = [v for v, s in enumerate(SOURCES) if len(s) > 1 and s[0] == b]
        if not members:
            continue
        logits = [float(nxt_logit[r])] + [float(new[r, v]) for v in members]
        top = max(logits)
        z = math.log(sum(math.exp(x - top) for x in logits)) + top
        alone_q = math.exp(logits[0] - z)
        left = 1.0
        for g, (first, second) in enumerate(keys):
            if first != b:
                continue
            p = math.exp(float(teacher[r, g]))
            q = sum(math.exp(float(new[r, v]) - z) for v in members if SOURCES[v][1] == second)
            total -= p * math.log(q)
            left -= p
        total -= max(left, 0.0) * math.log(alone_q)
    return total


def test_chain_ce_matches_a_float64_loop() -> None:
    torch.manual_seed(0)
    groups = chain_teacher.chain_groups(SOURCES, 10)
    assert groups.firsts.tolist() == [1, 1, 1, 4, 4, 1, -1]
    assert len(groups.group_first) == 5  # (1,2) holds two pieces
    rows, nxt = 6, [1, 4, 3, 1, 0, 4]  # 3 and 0 start no piece with a second id: no loss there
    new = torch.randn(rows, len(SOURCES), dtype=torch.float64, requires_grad=True)
    nxt_logit = torch.randn(rows, dtype=torch.float64)
    teacher = torch.log_softmax(torch.randn(rows, len(groups.group_first) + 3, dtype=torch.float64), -1)
    teacher = teacher[:, : len(groups.group_first)]  # the groups' seconds take part of the mass
    got = chain_teacher.chain_ce(new, nxt_logit, torch.tensor(nxt), groups, teacher)
    assert abs(float(got.detach()) - _reference(new.detach(), nxt_logit, nxt, teacher)) < 1e-6
    got.backward()
    assert new.grad is not None
    assert new.grad[[2, 4]].abs().sum() == 0  # rows 2 and 4 have no pieces: no gradient there
    assert new.grad[:, 6].abs().sum() == 0  # the one-id piece never takes part


def test_second_logprobs_normalise_over_the_whole_vocabulary() -> None:
    torch.manual_seed(1)
    hidden, head = torch.randn(300, 8), torch.randn(50, 8)  # more rows than one chunk
    cols = torch.tensor([3, 7, 7, 49])
    want = torch.log_softmax(hidden.double() @ head.double().t(), -1)[:, cols]
    torch.testing.assert_close(chain_teacher.second_logprobs(hidden, head, cols).double(), want, atol=1e-5, rtol=0)
    logits = hidden @ head.t()
    torch.testing.assert_close(chain_teacher.second_logprobs(logits, None, cols).double(), want, atol=1e-5, rtol=0)


def test_fit_with_the_chain_term_adds_it_to_the_loss_and_reports_it(
    tmp_path: Path, trained_base: Path, corpus: Any
) -> None:
    """Same seed, same first batch: the first loss grows by the chain term (a cross-entropy, > 0)."""
    fit = TrainParams(steps=2, batch_size=2, seq_len=32, lr=1e-3, warmup_steps=0, checkpoint_every=10)
    first = {}
    for weight in (0.0, 1.0):
        ctx = make_ctx(tmp_path, trained_base, corpus, f"embed{weight}")
        params = EmbedParams(eval_docs=0, domain_eval=[], fit=fit, fit_map=True, fit_chain_weight=weight)
        metrics = embed.run(ctx, params)
        assert metrics["fit"]["chain_weight"] == weight and metrics["fit"]["steps_run"] == 2
        first[weight] = metrics["fit"]["loss_first"]
    assert first[1.0] > first[0.0] + 1e-3, first
