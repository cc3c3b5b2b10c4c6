"""The one training loop every training stage shares: resumable, on accelerate or DeepSpeed.

Why one loop: checkpoint/resume, the cosine schedule, gradient accumulation, bf16 autocast,
the progress bar and tracker logging must behave the same in bootstrap, adaptation, the
long-context fine-tune and distillation, and a fix to one is a fix to all. Batches are a pure
function of (seed, step, micro-step, rank), so a resumed run sees exactly the batches the
killed run would have seen, with no data-loader state to save.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from warsha.artifacts import fsync_path, fsync_tree, write_json_atomic
from warsha.schema import check, ge, gt

if TYPE_CHECKING:
    import torch

    from warsha.stage import StageContext

log = logging.getLogger("warsha.training")
Batch = dict[str, Any]
STEP_FILE = "warsha_step.json"


@dataclass
class TrainParams:
    """Optimisation settings shared by all training stages (a ``train:`` block in a recipe)."""

    steps: int = field(default=100, metadata=check(ge(0), help="optimizer steps"))
    batch_size: int = field(default=8, metadata=check(ge(1), help="sequences per micro-batch per process"))
    seq_len: int = field(default=256, metadata=check(ge(8), help="tokens per sequence"))
    lr: float = field(default=1e-3, metadata=check(gt(0.0)))
    warmup_steps: int = field(default=10, metadata=check(ge(0)))
    min_lr_ratio: float = field(default=0.1, metadata=check(ge(0.0)))
    grad_accum: int = field(default=1, metadata=check(ge(1)))
    weight_decay: float = field(default=0.0, metadata=check(ge(0.0)))
    max_grad_norm: float = field(default=1.0, metadata=check(gt(0.0)))
    checkpoint_every: int = field(default=50, metadata=check(ge(1), help="steps between checkpoints"))
    log_every: int = field(default=10, metadata=check(ge(1)))
    eval_every: int = field(
        default=0, metadata=check(ge(0), help="held-out evaluation every N steps and at step 0, for curves (0: off)")
    )
    bf16: bool | None = field(
        default=None, metadata=check(help="bf16 autocast; null: where the device has fast bf16 (warsha.precision)")
    )


@dataclass
class TrainResult:
    """What a run did: the per-step losses and its throughput."""

    losses: list[float]
    tokens: int
    seconds: float
    resumed_from: int
    world_size: int = 1
    evals: list[dict[str, float]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Training throughput over the part of the run this process executed."""
        return self.tokens / max(self.seconds, 1e-9)

    def summary(self, n: int = 10) -> dict[str, float]:
        """Mean loss over the first and last ``n`` steps, and throughput."""
        head = self.losses[:n] or [math.nan]
        tail = self.losses[-n:] or [math.nan]
        return {
            "loss_first": sum(head) / len(head),
            "loss_last": sum(tail) / len(tail),
            "train_tokens_per_s": self.tokens_per_s,
            "steps_run": len(self.losses),
            "resumed_from_step": self.resumed_from,
            "world_size": self.world_size,
        }


def lr_multiplier(step: int, p: TrainParams) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` at the last step."""
    if step < p.warmup_steps:
        return (step + 1) / p.warmup_steps
    span = max(p.steps - p.warmup_steps, 1)
    progress = min((step - p.warmup_steps) / span, 1.0)
    return p.min_lr_ratio + (1 - p.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_accelerator(device: str, p: TrainParams, **kwargs: Any) -> Any:
    """An ``Accelerator`` on the recipe's device; ``cpu=True`` also makes gloo DDP work.

    accelerate keeps process-wide state; it is reset so that several stages (each with its own
    precision and accumulation) can run in one process, as the pipeline and tests do.
    """
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from warsha.precision import use_bf16

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    return Accelerator(
        cpu=cpu,
        mixed_precision="bf16" if use_bf16(p.bf16, "cpu" if cpu else "cuda") else "no",
        gradient_accumulation_steps=p.grad_accum,
        **kwargs,
    )


def make_optimizer(params: list[Any], p: TrainParams) -> Any:
    """AdamW over ``params``, fused into one kernel per step where every parameter allows it.

    Why: torch's default CPU AdamW launches a handful of elementwise ops per parameter tensor
    and walks each tensor several times; the fused kernel makes one pass. Same algorithm, same
    hyper-parameters; results differ only in float rounding. Fused needs floating-point tensors
    on the CPU or CUDA; anything else keeps the default implementation.
    """
    import torch

    fused = bool(params) and all(q.is_floating_point() and q.device.type in ("cpu", "cuda") for q in params)
    return torch.optim.AdamW(params, lr=p.lr, weight_decay=p.weight_decay, fused=fused or None)


def pack_documents(tokenizer: Any, texts: list[str], max_tokens: int | None = None) -> "torch.Tensor":
    """One long stream of BOS+document+EOS ids, the input that ``random_windows`` samples."""
    import torch

    ids: list[int] = []
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    for start in range(0, len(texts), 512):
        for doc in tokenizer(texts[start : start + 512], add_special_tokens=False)["input_ids"]:
            ids.extend(([bos] if bos is not None else []) + doc + ([eos] if eos is not None else []))
        if max_tokens and len(ids) >= max_tokens:
            break
    return torch.tensor(ids[:max_tokens] if max_tokens else ids, dtype=torch.long)


def random_windows(stream: "torch.Tensor", batch_size: int, seq_len: int, seed: int, *key: int) -> "torch.Tensor":
    """``batch_size`` windows of ``seq_len`` tokens at offsets fixed by ``(seed, *key)``."""
    import torch

    if len(stream) <= seq_len:
        raise ValueError(
            f"training data: {len(stream)} tokens cannot fill one sequence of {seq_len};"
            " add text or lower train.seq_len"
        )
    gen = torch.Generator().manual_seed(_mix(seed, *key))
    starts = torch.randint(0, len(stream) - seq_len, (batch_size,), generator=gen)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


def _mix(*values: int) -> int:
    h = 1469598103934665603
    for v in values:
        h = ((h ^ (v & 0xFFFFFFFF)) * 1099511628211) % 2**63
    return h


def check_ranks_in_sync(acc: Any, model: Any, name: str) -> bool:
    """Raise if data-parallel ranks ended with different weights.

    A launcher that silently starts independent single-process runs (docs/stack.md: ``accelerate
    launch --cpu``, or ``torchrun`` without ``cpu=True``) trains diverging copies with no
    error; comparing a float64 checksum of the parameters across ranks catches it.
    """
    import torch

    if acc.num_processes <= 1 or acc.distributed_type.name.startswith("DEEPSPEED"):
        return True
    with torch.no_grad():
        local = torch.stack(
            [
                sum(p.double().sum() for p in model.parameters()),
                sum(p.double().square().sum() for p in model.parameters()),
            ]
        )
    gathered = acc.gather(local.to(acc.device).unsqueeze(0)).cpu()
    if not torch.allclose(gathered, gathered[:1].expand_as(gathered), rtol=1e-9, atol=0):
        raise RuntimeError(f"{name}: parameters differ across {acc.num_processes} ranks after training")
    return True


def causal_lm_loss(model: Any, batch: Batch) -> "torch.Tensor":
    """The next-token loss of ``warsha.lm_loss`` (head and cross-entropy fused), imported on first
    use so that reading a recipe's training parameters does not import torch."""
    from warsha import lm_loss

    return lm_loss.causal_lm_loss(model, batch)


def _keeps_train_mode(module: Any) -> bool:
    """Whether a module must stay in training mode while the Trainer evaluates mid-run.

    bitsandbytes' ``Linear4bit`` repacks its weight into a CPU inference layout on its first
    eval-mode forward and never packs it back; every later training step then gets zero
    gradients through it (seen with bitsandbytes 0.50.2: QLoRA stopped learning after one
    evaluation). Left in training mode it computes the same outputs, as it has no dropout.
    """
    return type(module).__name__ in ("Linear4bit", "LinearNF4", "LinearFP4")


class TrainBackend(Protocol):
    """What the loop asks of the engine that runs it: the small part that differs between
    accelerate (`AccelerateBackend`, the default) and DeepSpeed (`tokenizer_ext.ds_train`).

    The schedule, the micro-batch loop, the NaN check, reporting, evaluation and the result
    are `Trainer`'s, the same for both.
    """

    rank: int
    world_size: int
    is_main: bool
    device: Any

    def prepare(self, model: Any, params: list[Any]) -> tuple[Any, Any]:
        """The model to call and the optimizer whose ``param_groups`` take the learning rate."""

    def micro_batch(self, model: Any) -> AbstractContextManager[Any]:
        """The context one micro-batch's forward, backward and step run in."""

    def backward(self, loss: Any) -> None:
        """Gradients of one micro-batch's loss."""

    def step(self, model: Any, opt: Any) -> None:
        """After each micro-batch's backward: clip and step where the accumulation is complete."""

    def save(self, root: Path, step: int, state: dict[str, Any]) -> None:
        """A complete checkpoint of step ``step`` under ``root``, carrying ``state``."""

    def resume(self, root: Path) -> dict[str, Any] | None:
        """Load the newest complete checkpoint under ``root``; its ``state`` (``step``, ``evals``)."""

    def finish(self, model: Any, name: str) -> Any:
        """After the last step, on every rank: the trained model as a plain module."""


@dataclass
class AccelerateBackend:
    """The loop on accelerate: DDP, bf16 autocast, gradient accumulation, ``step-N`` checkpoints.

    ``on_optimizer`` receives the torch optimizer once it exists, before accelerate wraps it.
    """

    acc: Any
    p: TrainParams
    on_optimizer: Callable[[Any], None] | None = None

    @property
    def rank(self) -> int:
        return int(self.acc.process_index)

    @property
    def world_size(self) -> int:
        return int(self.acc.num_processes)

    @property
    def is_main(self) -> bool:
        return bool(self.acc.is_main_process)

    @property
    def device(self) -> Any:
        return self.acc.device

    def prepare(self, model: Any, params: list[Any]) -> tuple[Any, Any]:
        opt = make_optimizer(params, self.p)
        if self.on_optimizer is not None:
            self.on_optimizer(opt)
        return self.acc.prepare(model, opt)

    def micro_batch(self, model: Any) -> AbstractContextManager[Any]:
        stack = ExitStack()
        stack.enter_context(self.acc.accumulate(model))
        stack.enter_context(self.acc.autocast())
        return stack

    def backward(self, loss: Any) -> None:
        self.acc.backward(loss)

    def step(self, model: Any, opt: Any) -> None:
        if self.acc.sync_gradients:
            self.acc.clip_grad_norm_(model.parameters(), self.p.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def save(self, root: Path, step: int, state: dict[str, Any]) -> None:
        """Write ``step-N`` so that it counts only once complete.

        The state is saved into ``step-N.tmp`` and fsynced; the step file, the marker of a
        complete checkpoint, is written last and atomically; then the directory is renamed and
        older checkpoints deleted. A kill or a full disk at any point leaves the previous
        checkpoint in charge and at most a ``.tmp`` that is ignored.
        """
        acc, t0 = self.acc, time.perf_counter()
        tmp, final = root / f"step-{step}.tmp", root / f"step-{step}"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True, exist_ok=True)
        acc.wait_for_everyone()
        save_state(acc, tmp)
        acc.wait_for_everyone()
        if acc.is_main_process:
            fsync_tree(tmp)
            write_json_atomic(tmp / STEP_FILE, state)
            if final.exists():  # an unusable leftover (its step file was unreadable)
                shutil.rmtree(final)
            tmp.rename(final)
            fsync_path(root)
            for old in root.glob("step-*"):
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
            log.info("%s: checkpoint at step %d (%.1f s)", root.name, step, time.perf_counter() - t0)
        acc.wait_for_everyone()

    def resume(self, root: Path) -> dict[str, Any] | None:
        best: tuple[Path, dict[str, Any]] | None = None
        for path in root.glob("step-*"):
            state = read_step_file(path)
            if state is not None and (best is None or state["step"] > best[1]["step"]):
                best = (path, state)
        if best is None:
            return None
        self.acc.load_state(str(best[0]))
        log.info("%s: resumed from checkpoint at step %d", root.name, best[1]["step"])
        return best[1]

    def finish(self, model: Any, name: str) -> Any:
        self.acc.wait_for_everyone()
        # keep_fp32_wrapper=False: otherwise forward stays wrapped in bf16 autocast after training
        # and every later evaluation silently runs in bf16.
        plain = self.acc.unwrap_model(model, keep_fp32_wrapper=False)
        check_ranks_in_sync(self.acc, plain, name)
        return plain


def eval_point(ctx: "StageContext", name: str, step: int, result: dict[str, Any]) -> dict[str, float]:
    """One point of a run's held-out curve (``TrainResult.evals``), logged to the stage's tracker."""
    point = {k: float(v) for k, v in result.items()}
    ctx.tracker.log({f"{name}/eval/{k}": v for k, v in point.items()}, step)
    return {"step": step, **point}


@dataclass
class Trainer:
    """Runs ``p.steps`` optimizer steps of ``model`` on batches from ``batch_fn``.

    ``batch_fn(step, micro, rank)`` returns a batch dict for one micro-batch; ``loss_fn``
    turns a batch into a scalar loss (default: causal LM loss). ``parameters`` restricts what
    is optimised (default: every parameter that requires grad); ``on_optimizer`` receives the
    torch optimizer once it exists, before accelerate wraps it (for step hooks). ``backend``
    runs the steps (default: `AccelerateBackend` on the stage's device).
    """

    model: Any
    p: TrainParams
    ctx: "StageContext"
    batch_fn: Callable[[int, int, int], Batch]
    loss_fn: Callable[[Any, Batch], "torch.Tensor"] = causal_lm_loss
    backend: TrainBackend | None = None
    name: str = "train"
    parameters: list[Any] | None = None
    eval_fn: Callable[[Any], dict[str, float]] | None = None
    on_optimizer: Callable[[Any], None] | None = None
    final_eval: bool = True
    """False: the caller scores the finished model with the same metrics anyway and adds that
    as the curve's last point (``eval_point``), so the loop does not score it twice."""

    def run(self) -> TrainResult:
        """Train, checkpointing every ``checkpoint_every`` steps; resume if a checkpoint exists."""

        from warsha.progress import progress

        backend = self.backend or AccelerateBackend(
            make_accelerator(self.ctx.device, self.p), self.p, self.on_optimizer
        )
        params = self.parameters or [q for q in self.model.parameters() if q.requires_grad]
        model, opt = backend.prepare(self.model, params)
        state = backend.resume(self._ckpt_root()) or {}
        start = int(state.get("step", 0))
        self._evals = list(state.get("evals", []))
        if start == 0:
            self._evaluate(backend, 0)
        losses: list[float] = []
        tokens, t0 = 0, time.perf_counter()
        bar = progress(
            range(start, self.p.steps),
            initial=start,
            total=self.p.steps,
            desc=self.name,
            disable=not backend.is_main,
            unit="step",
        )
        for step in bar:
            loss, n_tok = self.train_step(backend, model, opt, step)
            losses.append(loss)
            tokens += n_tok * backend.world_size
            self.report(bar, step, loss, tokens / max(time.perf_counter() - t0, 1e-9))
            if self._evaluates_at(step + 1):
                self._evaluate(backend, step + 1)
            if (step + 1) % self.p.checkpoint_every == 0 and step + 1 < self.p.steps:
                backend.save(self._ckpt_root(), step + 1, {"step": step + 1, "evals": self._evals})
        self.model = backend.finish(model, self.name)
        return TrainResult(losses, tokens, time.perf_counter() - t0, start, backend.world_size, self._evals)

    def _evaluates_at(self, step: int) -> bool:
        """Whether the loop scores the model after ``step`` steps: every ``eval_every`` and at the
        end, except at the end when the caller scores the finished model (``final_eval``)."""
        if not self.p.eval_every:
            return False
        if step == self.p.steps:
            return self.final_eval
        return step % self.p.eval_every == 0

    def _evaluate(self, backend: TrainBackend, step: int) -> None:
        """Held-out metrics at ``step`` on rank 0 (``eval_fn`` must not use collectives).

        Why inside the loop: a curve of held-out quality against steps is what shows whether a
        budget was enough; the final number alone cannot.
        """
        if self.eval_fn is None or not self.p.eval_every or not backend.is_main:
            return
        import torch

        modes = {m: m.training for m in self.model.modules()}
        for module in self.model.modules():
            module.training = _keeps_train_mode(module)
        with torch.no_grad():
            result = self.eval_fn(self.model)
        for module, mode in modes.items():
            module.training = mode
        self._evals.append(eval_point(self.ctx, self.name, step, result))

    def train_step(self, backend: TrainBackend, model: Any, opt: Any, step: int) -> tuple[float, int]:
        """One optimizer step (``grad_accum`` micro-batches): its mean loss and the tokens it saw.

        Public so that a measurement can time exactly the step `run` takes (benchmarks.train_bench).
        """
        # The learning rate is a pure function of the step: nothing to save or restore.
        for group in opt.param_groups:
            group["lr"] = self.p.lr * lr_multiplier(step, self.p)
        total, n_tok = 0.0, 0
        for micro in range(self.p.grad_accum):
            batch = {k: v.to(backend.device) for k, v in self.batch_fn(step, micro, backend.rank).items()}
            with backend.micro_batch(model):
                loss = self.loss_fn(model, batch)
                backend.backward(loss)
                backend.step(model, opt)
            total += float(loss.detach()) / self.p.grad_accum
            n_tok += int(batch["input_ids"].numel())
        if not math.isfinite(total):
            raise FloatingPointError(f"{self.name}: loss became {total} at step {step}; lower train.lr")
        return total, n_tok

    def report(self, bar: Any, step: int, loss: float, tok_s: float) -> None:
        """The step's loss and rate on the progress bar, and to the tracker every ``log_every`` steps."""
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
        if (step + 1) % self.p.log_every == 0 or step + 1 == self.p.steps:
            self.ctx.tracker.log({f"{self.name}/loss": loss, f"{self.name}/tokens_per_s": tok_s}, step + 1)

    def _ckpt_root(self) -> Path:
        return self.ctx.checkpoint_dir / self.name


class _TiedCopiesDropped(logging.Filter):
    """Drops accelerate's notice that it removed shared tensors while saving."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Removed shared tensor" not in record.getMessage()


def save_state(acc: Any, path: Path) -> None:
    """``acc.save_state`` without accelerate's "Removed shared tensor" warning at every checkpoint.

    safetensors cannot store two names for one storage, so accelerate keeps one name of each
    tied group and warns. With tied embeddings that is every QLoRA checkpoint of the adapt stage
    (peft's trainable-token delta of the head is the embedding's); loading restores the copy
    through the tie, which ``tests/warsha/test_checkpoint_ties.py`` checks.
    """
    quiet = _TiedCopiesDropped()
    target = logging.getLogger("accelerate.utils.other")
    target.addFilter(quiet)
    try:
        acc.save_state(str(path))
    finally:
        target.removeFilter(quiet)


def read_step_file(path: Path) -> dict[str, Any] | None:
    """The step file of a complete checkpoint directory ``step-N``; None for anything else
    (a ``.tmp`` left by a killed save, a missing or damaged step file, a mismatched step)."""
    match = re.fullmatch(r"step-(\d+)", path.name)
    if match is None:
        return None
    try:
        state = json.loads((path / STEP_FILE).read_text())
    except (OSError, ValueError):
        log.warning("%s: no readable %s; not a complete checkpoint, ignored", path, STEP_FILE)
        return None
    if not isinstance(state, dict) or state.get("step") != int(match.group(1)):
        log.warning("%s: %s does not name step %s; ignored", path, STEP_FILE, match.group(1))
        return None
    return state
