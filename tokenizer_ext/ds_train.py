"""Full / embeddings adaptation under DeepSpeed ZeRO-2 or ZeRO-3 (optionally CPU-offloaded Adam).

Why the DeepSpeed engine directly instead of accelerate's DeepSpeed plugin: on CPU the plugin
runs one process (and DeepSpeed's batch check then fails), while the engine trains correctly
when launched by ``torchrun`` or ``deepspeed --num_accelerators 2`` (docs/stack.md); on GPUs the
same engine is what the plugin would build. The loop is ``warsha.training.Trainer``'s (the
schedule, the NaN check, logging, the result); this module holds only what differs: the config,
the engine behind the loop's backend hook (`DeepSpeedBackend`), its checkpoints, and the
consolidated weights at the end.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warsha.artifacts import fsync_tree, write_json_atomic
from warsha.precision import use_bf16
from warsha.training import Trainer, TrainParams, TrainResult

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


def lm_loss(model: Any, batch: dict[str, Any]) -> Any:
    """The model's own causal-LM loss: the DeepSpeed engine is called like the HF model it wraps."""
    return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


@dataclass
class DeepSpeedBackend:
    """`warsha.training.TrainBackend` on a DeepSpeed engine: what differs from accelerate.

    The engine accumulates, clips and steps itself (``engine.step()`` after every micro-batch's
    ``engine.backward``), and its checkpoints are DeepSpeed's, marked complete by rank 0's
    ``warsha_latest.json`` once every rank has saved.
    """

    cfg: dict[str, Any]
    engine: Any = None

    def __post_init__(self) -> None:
        import torch.distributed as dist

        init_distributed()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0

    @property
    def device(self) -> Any:
        return self.engine.device

    def prepare(self, model: Any, params: list[Any]) -> tuple[Any, Any]:
        import deepspeed

        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=self.cfg)
        return self.engine, self.engine.optimizer

    def micro_batch(self, model: Any) -> AbstractContextManager[Any]:
        return nullcontext()

    def backward(self, loss: Any) -> None:
        self.engine.backward(loss)

    def step(self, model: Any, opt: Any) -> None:
        self.engine.step()

    def save(self, root: Path, step: int, state: dict[str, Any]) -> None:
        """Save tag ``step-N``; it counts only once every rank has saved and rank 0 has fsynced it
        and atomically written ``warsha_latest.json`` naming it.

        DeepSpeed's own ``latest`` file is written in place by rank 0 without waiting for the other
        ranks, so a kill can leave it empty or naming a tag another rank never finished.
        """
        import torch.distributed as dist

        tag = f"step-{step}"
        self.engine.save_checkpoint(str(root), tag=tag, client_state=state, save_latest=False)  # ends in a barrier
        if self.is_main:
            fsync_tree(root / tag)
            write_json_atomic(root / LATEST, {"tag": tag, "step": step})
            for old in root.glob("step-*"):
                if old.name != tag:
                    shutil.rmtree(old, ignore_errors=True)
        dist.barrier()

    def resume(self, root: Path) -> dict[str, Any] | None:
        try:
            mark = json.loads((root / LATEST).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(mark, dict) or not isinstance(mark.get("tag"), str) or not (root / mark["tag"]).is_dir():
            return None
        path, client = self.engine.load_checkpoint(str(root), tag=mark["tag"])
        if path is None:
            raise RuntimeError(
                f"{root / mark['tag']}: DeepSpeed could not load this checkpoint; delete {root} to restart"
            )
        return {"step": int((client or {}).get("step", mark.get("step", 0))), "evals": (client or {}).get("evals", [])}

    def finish(self, model: Any, name: str) -> Any:
        return self.engine.module


def train(
    model: Any,
    p: TrainParams,
    ctx: "StageContext",
    batch_fn: Callable[[int, int, int], dict[str, Any]],
    cfg: dict[str, Any],
    name: str,
) -> tuple[TrainResult, dict[str, Any] | None]:
    """Train under ZeRO (`warsha.training.Trainer` on `DeepSpeedBackend`); return the result and,
    on rank 0, the full (consolidated) state dict."""
    backend = DeepSpeedBackend(cfg)
    result = Trainer(model, p, ctx, batch_fn, loss_fn=lm_loss, backend=backend, name=name).run()
    state = full_state_dict(backend.engine, cfg)
    return result, state if backend.is_main else None


def full_state_dict(engine: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """The whole model's weights (a collective under ZeRO-3: every rank must call it)."""
    if zero_stage(cfg) == 3:
        return engine._zero3_consolidated_16bit_state_dict()
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def world_size() -> int:
    """Processes the launcher started (1 when run plainly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))
