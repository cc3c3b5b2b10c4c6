"""Distillation and the honest baseline, both on warsha's shared resumable Trainer.

The distilled draft minimises a divergence to the target's full-vocabulary distribution,
computed on the fly by a frozen bf16 teacher, on a mix of corpus chunks and continuations
sampled while training. The baseline is the same draft, from the same initialisation, trained
for the same number of steps on the same corpus chunks with the plain next-token loss and no
teacher: the gap between the two is what the teacher buys, rather than what training alone buys.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distill.data import Pools, off_policy_batch, on_policy_batch, step_rng
from distill.losses import compress_topk, expand_topk, masked_mean, teacher_logprobs, token_divergence

if TYPE_CHECKING:
    import torch

    from warsha.stage import StageContext
    from warsha.training import TrainParams


@dataclass
class DistillSpec:
    """How the teacher's signal is turned into batches and a loss (the stage's params)."""

    loss: str = "fkl"
    temperature: float = 1.0
    on_policy_fraction: float = 0.5
    on_policy_source: str = "draft"  # draft | target | mixed
    prompt_len: int = 16
    gen_len: int = 48
    gen_temperature: float = 1.0
    teacher_cache_topk: int = 0


class TopkCache:
    """Optional cache of the teacher's top-k log-probabilities per off-policy chunk.

    Off for the default (teacher logits on the fly are exact and cheap at these sizes); it pays
    when a large teacher revisits the same chunks over several epochs. The dropped mass is
    spread uniformly (:func:`distill.losses.expand_topk`) so reverse KL stays finite."""

    def __init__(self, k: int, vocab: int) -> None:
        self.k, self.vocab = k, vocab
        self.store: dict[int, tuple["torch.Tensor", "torch.Tensor"]] = {}
        self.hits = 0

    def logprobs(self, teacher: Any, pools: Pools, idx: list[int], temperature: float) -> "torch.Tensor":
        """Full teacher log-probs for chunks ``idx``, computing only the chunks not cached."""
        import torch

        missing = [i for i in dict.fromkeys(idx) if i not in self.store]
        self.hits += len(idx) - len(missing)
        if missing:
            with torch.inference_mode():
                lp = teacher_logprobs(teacher(input_ids=pools.chunks[missing]).logits, temperature)
            for row, i in enumerate(missing):
                vals, ids = compress_topk(lp[row], self.k)
                self.store[i] = (vals.clone(), ids.clone())
        return torch.stack([expand_topk(*self.store[i], self.vocab) for i in idx])


def chunk_indices(pools: Pools, step: int, batch_size: int, seed: int) -> list[int]:
    """The chunk indices :func:`distill.data.off_policy_batch` picks for ``step``."""
    rng = step_rng(seed, step, "off")
    return [rng.randrange(pools.chunks.shape[0]) for _ in range(batch_size)]


def is_on_policy(step: int, fraction: float, seed: int) -> bool:
    """Whether ``step`` trains on sampled continuations (a pure function of seed and step)."""
    return fraction > 0 and step_rng(seed, step, "mix").random() < fraction


def distill_batches(
    student: Any,
    teacher: Any,
    pools: Pools,
    spec: DistillSpec,
    batch_size: int,
    seed: int,
    cache: TopkCache | None = None,
    columns: "torch.Tensor | None" = None,
) -> Any:
    """The ``batch_fn`` for distillation: off-policy chunks or on-policy samples, per step.
    ``columns``: vocabulary ids of the logit columns of heads restricted to the draft's ids."""

    def batch_fn(step: int, micro: int, rank: int) -> dict[str, Any]:
        key = (step * 1009 + micro) * 131 + rank
        if is_on_policy(key, spec.on_policy_fraction, seed):
            src = spec.on_policy_source
            if src == "mixed":
                src = "draft" if step_rng(seed, key, "who").random() < 0.5 else "target"
            sampler = student if src == "draft" else teacher
            ids, mask = on_policy_batch(
                sampler, pools, key, batch_size, spec.gen_len, spec.gen_temperature, seed, columns
            )
            return {"input_ids": ids, "mask": mask}
        ids, mask = off_policy_batch(pools, key, batch_size, seed)
        batch = {"input_ids": ids, "mask": mask}
        if cache is not None:
            idx = chunk_indices(pools, key, batch_size, seed)
            batch["teacher_logprobs"] = cache.logprobs(teacher, pools, idx, spec.temperature)
        return batch

    return batch_fn


def distill_loss(teacher: Any, spec: DistillSpec) -> Any:
    """The ``loss_fn``: the chosen divergence at the masked positions, teacher on the fly."""
    import torch

    def loss_fn(model: Any, batch: dict[str, Any]) -> "torch.Tensor":
        ids = batch["input_ids"]
        if "teacher_logprobs" in batch:
            t_lp = batch["teacher_logprobs"]
        else:
            with torch.no_grad():
                t_lp = teacher_logprobs(teacher(input_ids=ids).logits, spec.temperature)
        s_logits = model(input_ids=ids).logits
        per_token = token_divergence(s_logits, t_lp, spec.loss, spec.temperature)
        return masked_mean(per_token, batch["mask"])

    return loss_fn


def baseline_batches(pools: Pools, batch_size: int, seed: int) -> Any:
    """The baseline's ``batch_fn``: the same corpus chunk stream the distilled draft samples."""

    def batch_fn(step: int, micro: int, rank: int) -> dict[str, Any]:
        key = (step * 1009 + micro) * 131 + rank
        ids, _ = off_policy_batch(pools, key, batch_size, seed)
        return {"input_ids": ids}

    return batch_fn


def train_or_load(
    ctx: "StageContext", name: str, model: Any, params: "TrainParams", batch_fn: Any, loss_fn: Any = None
) -> tuple[Any, dict[str, Any]]:
    """Run the shared Trainer, or reload the finished weights if an earlier run completed.

    The Trainer checkpoints only before its last step; keeping the finished weights under the
    checkpoint directory means a run killed during the *second* training (the baseline) does
    not redo the first."""
    import copy
    import json

    import torch

    from warsha.artifacts import fsync_tree, write_json_atomic
    from warsha.training import Trainer, causal_lm_loss

    done = Path(ctx.checkpoint_dir) / f"{name}-final"
    if (done / "summary.json").is_file():
        state = torch.load(done / "weights.pt", map_location="cpu", weights_only=True)
        model.load_state_dict(state)
        return model, json.loads((done / "summary.json").read_text())
    # accelerate patches the prepared model's forward with bf16 autocast and unwrap_model keeps
    # that patch, so the trained weights go back into an untouched copy: evaluation after
    # training must run at the precision the caller chose, identical to a reloaded draft.
    clean = copy.deepcopy(model)
    trainer = Trainer(model, params, ctx, batch_fn, loss_fn=loss_fn or causal_lm_loss, name=name)
    result = trainer.run()
    clean.load_state_dict(trainer.model.state_dict())
    model = clean
    summary = result.summary()
    if ctx.is_main:
        done.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), done / "weights.pt")
        fsync_tree(done)
        write_json_atomic(done / "summary.json", summary)  # last: it marks the weights complete
    return model, summary
