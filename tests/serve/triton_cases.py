"""Helpers for the Triton kernel tests: device choice, interpreter guard, random paged batches.

On a machine without CUDA the kernels run in Triton's interpreter; tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports triton. `kernel_device()` fails loudly (instead of
skipping) if that did not happen, e.g. when a test file is run in a process that imported
triton earlier without the variable.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch

from serve.attention import SeqChunk


def kernel_device() -> torch.device:
    """cuda when present, else cpu under the interpreter (asserted, never skipped)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    assert os.environ.get("TRITON_INTERPRET") == "1", (
        "tests/conftest.py must set TRITON_INTERPRET=1 before triton is imported"
    )
    from triton.runtime.interpreter import InterpretedFunction

    from serve.attention import triton_decode

    assert isinstance(triton_decode._decode_partition_kernel, InterpretedFunction), (
        "serve's Triton kernels were compiled for a GPU: triton was imported before TRITON_INTERPRET=1 was set"
    )
    return torch.device("cpu")


def nan_alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Replacement for triton_common.alloc: every buffer starts as NaN, so unwritten elements show."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@dataclass
class PagedCase:
    """A random batch over one layer's paged cache, K/V of the new tokens already written."""

    q: torch.Tensor  # [T, H, D]
    k_new: torch.Tensor  # [T, Hkv, D]
    v_new: torch.Tensor
    k_cache: torch.Tensor  # [Hkv, slots, D]
    v_cache: torch.Tensor
    chunks: list[SeqChunk]
    used_slots: torch.Tensor  # every slot inside some sequence's context


def paged_case(
    seed: int,
    specs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    poison_unused: bool = False,
    spare_blocks: int = 3,
) -> PagedCase:
    """Sequences (context_len, query_len) with shuffled block tables over one random cache.

    With `poison_unused`, every cache slot outside all contexts (tails of last blocks, free
    blocks) is NaN: a kernel that reads past a context length then yields NaN.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-ctx // block_size) for ctx, _ in specs)
    free = list(range(need + spare_blocks))
    rng.shuffle(free)
    slots_total = (need + spare_blocks) * block_size
    k_cache = torch.randn(kv_heads, slots_total, dim, generator=gen)
    v_cache = torch.randn(kv_heads, slots_total, dim, generator=gen)
    chunks, used, new_slots, start = [], [], [], 0
    for ctx, q_len in specs:
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        slots = [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        used += slots
        new_slots += slots[ctx - q_len :]
        chunks.append(SeqChunk(start, q_len, ctx, table))
        start += q_len
    if poison_unused:
        unused = torch.ones(slots_total, dtype=torch.bool)
        unused[used] = False
        k_cache[:, unused] = float("nan")
        v_cache[:, unused] = float("nan")
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    idx = torch.tensor(new_slots)
    q = torch.randn(start, heads, dim, generator=gen).to(dtype)
    return PagedCase(
        q,
        k_cache[:, idx].transpose(0, 1).contiguous(),
        v_cache[:, idx].transpose(0, 1).contiguous(),
        k_cache,
        v_cache,
        chunks,
        torch.tensor(sorted(used)),
    )


def to_device(case: PagedCase, device: torch.device) -> PagedCase:
    """The same case with its tensors on `device`."""
    t = [x.to(device) for x in (case.q, case.k_new, case.v_new, case.k_cache, case.v_cache)]
    return PagedCase(*t, case.chunks, case.used_slots)
