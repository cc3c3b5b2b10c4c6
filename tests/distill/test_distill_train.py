"""Distillation on the shared Trainer: it moves the draft toward the target, resumes exactly,
and the optional top-k cache serves the teacher it would have computed."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from distill.data import build_pools, encode_docs, off_policy_batch, on_policy_batch
from distill.draft import layer_subset
from distill.losses import compress_topk, expand_topk, teacher_logprobs
from distill.train import DistillSpec, TopkCache, distill_batches, distill_loss, train_or_load
from warsha.speculative import analytic_acceptance
from warsha.training import TrainParams


@pytest.fixture(scope="module")
def pools(tokenizer: Any, corpus: Any) -> Any:
    texts = corpus.texts("ar", "train")[:60] + corpus.texts("en", "train")[:60]
    return build_pools(encode_docs(tokenizer, texts), seq_len=48, prompt_len=8, seed=0)


def _held_out(tokenizer: Any, corpus: Any) -> list[list[int]]:
    texts = corpus.texts("ar", "validation")[:6] + corpus.texts("en", "validation")[:6]
    return [d[:48] for d in encode_docs(tokenizer, texts)]


def test_pools_and_batches_are_deterministic(pools: Any, target: Any) -> None:
    assert pools.chunks.shape[1] == 48 and pools.prompts.shape[1] == 8
    a, ma = off_policy_batch(pools, 3, 4, seed=0)
    b, _ = off_policy_batch(pools, 3, 4, seed=0)
    assert torch.equal(a, b) and ma.all()
    ids, mask = on_policy_batch(target, pools, 5, 3, gen_len=6, temperature=1.0, seed=0)
    again, _ = on_policy_batch(target, pools, 5, 3, gen_len=6, temperature=1.0, seed=0)
    assert ids.shape == (3, 14) and torch.equal(ids, again)
    assert mask[:, 7:13].all() and not mask[:, :7].any() and not mask[:, 13].any()


def test_restricted_head_samples_vocabulary_ids(pools: Any, target: Any) -> None:
    """A head over some ids samples among them, returned as vocabulary ids: at temperature 0,
    the full model's argmax over those ids at every step (a brute-force loop, no cache)."""
    import copy

    from distill.draft_vocab import restrict_head

    ids = list(range(3, target.config.vocab_size, 7))
    restricted = copy.deepcopy(target)
    restrict_head(restricted, ids)
    columns = torch.tensor(ids)
    got, _ = on_policy_batch(restricted, pools, 5, 3, gen_len=6, temperature=0.0, seed=0, columns=columns)
    seqs, _ = on_policy_batch(target, pools, 5, 3, gen_len=0, temperature=0.0, seed=0)
    with torch.inference_mode():
        for _ in range(6):
            logits = target(input_ids=seqs).logits[:, -1, columns]
            seqs = torch.cat([seqs, columns[logits.argmax(-1)].unsqueeze(1)], dim=1)
    assert torch.equal(got, seqs)
    sampled, _ = on_policy_batch(restricted, pools, 6, 3, gen_len=6, temperature=1.0, seed=0, columns=columns)
    assert set(sampled[:, 8:].flatten().tolist()) <= set(ids)


@pytest.mark.parametrize("loss", ["fkl", "tvd"])
def test_distillation_raises_acceptance(
    tmp_path: Path, target: Any, tokenizer: Any, corpus: Any, pools: Any, ctx_factory: Any, loss: str
) -> None:
    teacher = copy.deepcopy(target).to(torch.bfloat16).requires_grad_(False)
    init = layer_subset(target, [0])
    held = _held_out(tokenizer, corpus)
    before = analytic_acceptance(target, init, held)
    spec = DistillSpec(loss=loss, on_policy_fraction=0.5, prompt_len=8, gen_len=16)
    student = copy.deepcopy(init).train()
    params = TrainParams(steps=25, batch_size=8, seq_len=48, lr=3e-3, warmup_steps=2, checkpoint_every=100)
    ctx = ctx_factory(tmp_path)
    trained, summary = train_or_load(
        ctx,
        "distill",
        student,
        params,
        distill_batches(student, teacher, pools, spec, 8, 0),
        distill_loss(teacher, spec),
    )
    after = analytic_acceptance(target, trained.float().eval(), held)
    assert summary["loss_last"] < summary["loss_first"]
    assert after["t1"] > before["t1"] + 0.02, (before, after)


def test_resume_gives_the_same_weights(tmp_path: Path, target: Any, pools: Any, ctx_factory: Any) -> None:
    teacher = copy.deepcopy(target).to(torch.bfloat16).requires_grad_(False)
    init = layer_subset(target, [0])
    spec = DistillSpec(on_policy_fraction=0.5, prompt_len=8, gen_len=6)
    params = TrainParams(steps=4, batch_size=2, seq_len=48, lr=1e-3, warmup_steps=1, checkpoint_every=2)

    def train(ctx: Any, crash_at: int | None) -> Any:
        student = copy.deepcopy(init).train()
        inner = distill_batches(student, teacher, pools, spec, 2, 0)

        def batch_fn(step: int, micro: int, rank: int) -> dict[str, Any]:
            if step == crash_at:
                raise KeyboardInterrupt("killed")
            return inner(step, micro, rank)

        return train_or_load(ctx, "distill", student, params, batch_fn, distill_loss(teacher, spec))

    straight, _ = train(ctx_factory(tmp_path / "a"), None)
    ctx = ctx_factory(tmp_path / "b")
    with pytest.raises(KeyboardInterrupt):
        train(ctx, crash_at=3)
    assert (ctx.checkpoint_dir / "distill" / "step-2").is_dir()
    resumed, summary = train(ctx, None)
    assert summary["resumed_from_step"] == 2
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)
    # a finished run is reloaded, never retrained
    again, _ = train(ctx, crash_at=0)
    torch.testing.assert_close(again.state_dict()["lm_head.weight"], resumed.state_dict()["lm_head.weight"])


def test_topk_cache_serves_what_the_teacher_computes(target: Any, pools: Any) -> None:
    cache = TopkCache(k=20, vocab=target.config.vocab_size)
    got = cache.logprobs(target, pools, [0, 1, 0], temperature=1.0)
    with torch.inference_mode():
        lp = teacher_logprobs(target(input_ids=pools.chunks[[0, 1]]).logits, 1.0)
    want = expand_topk(*compress_topk(lp, 20), target.config.vocab_size)
    torch.testing.assert_close(got, want[[0, 1, 0]])
    assert cache.hits == 1
    cache.logprobs(target, pools, [1], temperature=1.0)
    assert cache.hits == 2
