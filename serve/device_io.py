"""Host-to-device traffic of a serving step, in one place.

Why: on a GPU every tensor the host builds for a step is a copy to the device, and every value
the host reads back is a synchronisation that stalls the queue of kernels. A step's rule is:
tensors built from Python values (token ids, positions, block tables, sampling parameters, the
per-request random draws) are built on the host inside `staging()` and reach the device through
`to_device` (pinned memory, non-blocking on CUDA); the only values read back are sampled token
ids, through `to_host`, once per forward (and the logprobs a request asked for). Everything else
is created on the model's device. On the CPU the same calls cost nothing.
`tests/serve/test_device_step.py` runs engine steps on the meta device under a dispatch-mode
watch that fails on any CPU tensor used outside `staging()`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch

_state = threading.local()


@contextlib.contextmanager
def staging() -> Iterator[None]:
    """Mark host tensors built inside as step inputs bound for the device (see the module doc)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def is_staging() -> bool:
    """Whether the calling thread is inside `staging()` (the device-step test reads it)."""
    return getattr(_state, "depth", 0) > 0


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host-built tensor on `device`: on CUDA through pinned memory, without blocking.

    A copy from pageable memory makes the host wait while the driver stages it; from pinned
    memory it is one asynchronous DMA queued on the stream, ordered before the kernels that read
    it, and torch's pinned allocator keeps the host buffer until the copy has finished.
    """
    device = torch.device(device)
    if t.device == device:
        return t
    with staging():
        if device.type != "cuda" or t.device.type != "cpu":
            return t.to(device)
        return t.pin_memory().to(device, non_blocking=True)


def tensor(values: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` built on the host and staged to `device`."""
    with staging():
        return to_device(torch.tensor(values, dtype=dtype), device)


def to_host(values: torch.Tensor) -> list:
    """A step's read-back as Python lists: sampled ids (with verification's accepted counts) once
    per forward, and the logprobs a request asked for. Each call on a GPU waits for the queue."""
    return values.tolist()
