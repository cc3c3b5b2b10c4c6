"""Full / embeddings adaptation under DeepSpeed ZeRO-2 or ZeRO-3 (optionally CPU-offloaded Adam).

Why the DeepSpeed engine directly instead of accelerate's DeepSpeed plugin: on CPU the plugin
runs one process (and DeepSpeed's batch check then fails), while the engine trains correctly
when launched by ``torchrun`` or ``deepspeed --num_accelerators 2`` (docs/stack.md); on GPUs the
same engine is what the plugin would build. Everything else mirrors ``warsha.training``: the
same cosine schedule (``lr_multiplier``), batches that are a pure function of (seed, step,
micro-step, rank) so a resumed run sees the same data, tracker logging and a tokens/s bar.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warsha.artifacts import fsync_tree, write_json_atomic
from warsha.precision import use_bf16
from warsha.training import TrainParams, TrainResult, lr_multiplier

if TYPE_CHECKING:
    from warsha.stage import StageContext

LATEST = "warsha_latest.json"


def load_config(path: str | Path, p: TrainParams, world: int, offload: bool) -> dict[str, Any]:
    """Read a DeepSpeed JSON and resolve its ``"auto"`` values from the training params."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"deepspeed: no such config {str(path)!r} (see recipes/deepspeed/*.json)")
    cfg = json.loads(path.read_text())
    auto = {
        "train_micro_batch_size_per_gpu": p.batch_size,
        "gradient_accumulation_steps": p.grad_accum,
        "train_batch_size": p.batch_size * p.grad_accum * world,
        "gradient_clipping": p.max_grad_norm,
    }
    for key, value in auto.items():
        if cfg.get(key, "auto") == "auto":
            cfg[key] = value
    cfg.setdefault("bf16", {})["enabled"] = use_bf16(p.bf16, "auto")
    opt = cfg.setdefault("optimizer", {"type": "AdamW", "params": {}})
    params = opt.setdefault("params", {})
    for key, value in (("lr", p.lr), ("weight_decay", p.weight_decay)):
        if params.get(key, "auto") == "auto":
            params[key] = value
    zero = cfg.setdefault("zero_optimization", {})
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if zero.get("offload_optimizer", {}).get("device") == "cpu":
        opt["type"] = "AdamW"  # DeepSpeed swaps in its CPU Adam for offloaded state
        params.setdefault("torch_adam", False)
    elif not _has_cuda():
        params["torch_adam"] = True  # FusedAdam needs CUDA; torch's AdamW runs anywhere
    return cfg


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def zero_stage(cfg: dict[str, Any]) -> int:
    """The ZeRO stage a config asks for (0 when absent)."""
    return int(cfg.get("zero_optimization", {}).get("stage", 0))


def init_distributed() -> None:
    """Join the process group ``torchrun``/``deepspeed`` set up (gloo on CPU)."""
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def train(
    model: Any,
    p: TrainParams,
    ctx: "StageContext",
    batch_fn: Callable[[int, int, int], dict[str, Any]],
    cfg: dict[str, Any],
    name: str,
) -> tuple[TrainResult, dict[str, Any] | None]:
    """Train under ZeRO; return the result and, on rank 0, the full (consolidated) state dict."""
    import deepspeed
    import torch.distributed as dist

    from warsha.progress import progress

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    params = [q for q in model.parameters() if q.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
    ckpt = ctx.checkpoint_dir / name
    start = _resume(engine, ckpt)
    losses: list[float] = []
    tokens, t0 = 0, time.perf_counter()
    bar = progress(range(start, p.steps), initial=start, total=p.steps, desc=name, disable=rank != 0, unit="step")
    for step in bar:
        for group in engine.optimizer.param_groups:
            group["lr"] = p.lr * lr_multiplier(step, p)
        total = 0.0
        for micro in range(p.grad_accum):
            batch = {k: v.to(engine.device) for k, v in batch_fn(step, micro, rank).items()}
            loss = engine(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            engine.backward(loss)
            engine.step()
            total += float(loss.detach()) / p.grad_accum
            tokens += int(batch["input_ids"].numel()) * world
        if not math.isfinite(total):
            raise FloatingPointError(f"{name}: loss became {total} at step {step}; lower train.lr")
        losses.append(total)
        tok_s = tokens / max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix(loss=f"{total:.3f}", tok_s=f"{tok_s:,.0f}")
        if rank == 0 and ((step + 1) % p.log_every == 0 or step + 1 == p.steps):
            ctx.tracker.log({f"{name}/loss": total, f"{name}/tokens_per_s": tok_s}, step + 1)
        if (step + 1) % p.checkpoint_every == 0 and step + 1 < p.steps:
            _save(engine, ckpt, step + 1, rank)
    result = TrainResult(losses, tokens, time.perf_counter() - t0, start)
    state = full_state_dict(engine, cfg)
    return result, state if rank == 0 else None


def _save(engine: Any, ckpt: Path, step: int, rank: int) -> None:
    """Save tag ``step-N``; it counts only once every rank has saved and rank 0 has fsynced it
    and atomically written ``warsha_latest.json`` naming it.

    DeepSpeed's own ``latest`` file is written in place by rank 0 without waiting for the other
    ranks, so a kill can leave it empty or naming a tag another rank never finished.
    """
    import torch.distributed as dist

    tag = f"step-{step}"
    engine.save_checkpoint(str(ckpt), tag=tag, client_state={"step": step}, save_latest=False)  # ends in a barrier
    if rank == 0:
        fsync_tree(ckpt / tag)
        write_json_atomic(ckpt / LATEST, {"tag": tag, "step": step})
        for old in ckpt.glob("step-*"):
            if old.name != tag:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def _resume(engine: Any, ckpt: Path) -> int:
    try:
        mark = json.loads((ckpt / LATEST).read_text())
    except (OSError, ValueError):
        return 0
    if not isinstance(mark, dict) or not isinstance(mark.get("tag"), str) or not (ckpt / mark["tag"]).is_dir():
        return 0
    path, client = engine.load_checkpoint(str(ckpt), tag=mark["tag"])
    if path is None:
        raise RuntimeError(f"{ckpt / mark['tag']}: DeepSpeed could not load this checkpoint; delete {ckpt} to restart")
    return int((client or {}).get("step", mark.get("step", 0)))


def full_state_dict(engine: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """The whole model's weights (a collective under ZeRO-3: every rank must call it)."""
    if zero_stage(cfg) == 3:
        return engine._zero3_consolidated_16bit_state_dict()
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def world_size() -> int:
    """Processes the launcher started (1 when run plainly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))
