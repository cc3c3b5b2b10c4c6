"""Which floating-point precision is fast on the device at hand.

Why this exists: bf16 is the right default on GPUs and on CPUs with native bf16 arithmetic
(AVX512-BF16 or AMX), where it halves memory traffic and speeds up matmuls. On a CPU without
them (AVX2 only, e.g. AMD Zen 2/3), PyTorch emulates bf16 matmuls and they are far slower than
float32 (docs/precision.md has the measured ratios). A silent bf16 default would turn the
demo's minutes into hours, so every stage asks this module instead of assuming.

``bf16: null`` (the default everywhere) means "bf16 where it is fast"; ``true`` or ``false``
in a recipe forces it.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=8)
def bf16_is_fast(device: str = "cpu") -> bool:
    """True on a CUDA device with bf16 support or a CPU with AVX512-BF16 or AMX tiles."""
    import torch

    kind = str(device).split(":")[0]
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    cpu = getattr(torch, "cpu", None)
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in probes)


def use_bf16(flag: bool | None, device: str = "cpu") -> bool:
    """Resolve a recipe's ``bf16`` field: an explicit choice wins, ``None`` asks the hardware."""
    return bf16_is_fast(device) if flag is None else bool(flag)


def compute_dtype(flag: bool | None = None, device: str = "cpu") -> Any:
    """``torch.bfloat16`` where bf16 is used, else ``torch.float32``."""
    import torch

    return torch.bfloat16 if use_bf16(flag, device) else torch.float32


def dtype_name(flag: bool | None = None, device: str = "cpu") -> str:
    """The same choice as a name (``bfloat16`` / ``float32``), for configs that take strings."""
    return "bfloat16" if use_bf16(flag, device) else "float32"
