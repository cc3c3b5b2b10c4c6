"""Whether this CPU computes bf16 matmuls natively, and where bf16 weights run in float32.

Why: with AVX512-BF16 or AMX, bf16 GEMMs are fast and the serving engine runs bf16 end to end.
On an AVX2-only CPU (AMD Zen 2/3, older Intel) PyTorch emulates them, several times slower
than float32 for GEMMs, LM heads and batched attention matmuls (docs/precision.md). Only
matrix-vector products (a batch-1 decode step) stay faster in bf16, because they are bound by
memory traffic and bf16 halves it.

So on such CPUs a bf16 model keeps bf16 weights, activations and KV cache, but its matmuls
upcast to float32 (the bf16 values are exact in float32, products accumulate in float32 as a
native bf16 GEMM does) and round the result back to bf16 once: the same rounding points as a
bf16 model, far faster. This module is serve's own (serve never imports warsha).
"""

from __future__ import annotations

import functools

import torch

# A single row (batch-1 decode) keeps the bf16 kernel: a matrix-vector product is bound by
# memory traffic, which bf16 halves; from UPCAST_MIN_ROWS rows on, float32 (oneDNN-packed) wins.
UPCAST_MIN_ROWS = 2


@functools.lru_cache(maxsize=1)
def bf16_matmul_is_fast() -> bool:
    """True on a CPU with AVX512-BF16 or AMX tiles (native bf16 dot products)."""
    cpu = getattr(torch, "cpu", None)
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in probes)


def upcast_bf16_default(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Run bf16 matmuls in float32 here? Only bf16 on a CPU without native bf16 arithmetic."""
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not bf16_matmul_is_fast()
