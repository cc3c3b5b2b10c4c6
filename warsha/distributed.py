"""Process rank and barriers for runs under ``accelerate launch``, ``torchrun`` or ``deepspeed``.

Every process runs every stage (training needs them all), but only rank 0 writes artifacts;
the others wait at a barrier so that no process reads an artifact before it is in place.
Rank and world size come from the launcher's environment, so a single-process run never
imports torch.distributed at all.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def world_size() -> int:
    """Number of processes the launcher started (1 when not launched)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's global rank (0 when not launched)."""
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """Whether this process writes artifacts."""
    return rank() == 0


def init(device: str) -> None:
    """Create the process group once, on CPU with gloo when there is no GPU (docs/stack.md)."""
    if world_size() <= 1:
        return
    import torch
    from accelerate import PartialState

    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    PartialState(cpu=cpu)


def shutdown() -> None:
    """Wait for every process, then tear the process group down before the interpreter exits.

    Why: a gloo group left to interpreter shutdown sometimes aborts a rank with "terminate called
    without an active exception" after all work is done (seen in the two-process CPU test), and
    the launcher then reports the whole run as failed.
    """
    if world_size() <= 1:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def leave(code: int = 0) -> NoReturn:
    """End a launched process after `shutdown` without the interpreter's teardown.

    Why: with the group destroyed, a rank of the two-process CPU test still aborted at exit now
    and then ("terminate called without an active exception": a C++ thread object of the
    distributed runtime destroyed while joinable), and the launcher then reported a finished run
    as failed. Every artifact is on disk by then; logs and standard streams are flushed first.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def barrier() -> None:
    """Wait for every process (no-op when single-process)."""
    if world_size() <= 1:
        return
    from accelerate import PartialState

    PartialState().wait_for_everyone()
