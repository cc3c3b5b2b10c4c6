"""KV-cache write through the slot mapping, into the heads-first cache [Hkv, slots, D].

Grid (token tiles, KV heads): each program copies BLOCK_T tokens' K and V rows of one KV head
to their slots. A negative slot means "do not store" (padding rows of a batch padded to a fixed
size, as CUDA graphs need); serve's engine today never produces one (every scheduled token has
a slot), but the kernel honours the convention so that padding can be added without a second
code path. Values are cast to the cache dtype on store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serve.attention import triton_common as common
from serve.attention.triton_common import round_to


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ch,
    stride_cs,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Copy BLOCK_T tokens of one KV head to their slots, skipping slots < 0."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < num_tokens
    slot = tl.load(slots_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    ok = (t_ok & (slot >= 0))[:, None] & (d < HEAD_DIM)[None, :]
    tt = t.to(tl.int64)[:, None]
    k = tl.load(k_ptr + tt * stride_kt + head * stride_kh + d[None, :], mask=ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + tt * stride_vt + head * stride_vh + d[None, :], mask=ok, other=0.0).to(tl.float32)
    dst = head.to(tl.int64) * stride_ch + slot[:, None] * stride_cs + d[None, :]
    tl.store(k_cache_ptr + dst, round_to(k, k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + dst, round_to(v, v_cache_ptr.dtype.element_ty), mask=ok)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store k, v [T, Hkv, D] at `slots` [T] of one layer's caches [Hkv, slots, D] (slot < 0: skip)."""
    common.check_device("write_kv", k_cache, v_cache, slots, k, v)
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (k_cache.shape[0], k_cache.shape[2]):
        raise ValueError(
            f"write_kv: k/v {tuple(k.shape)}/{tuple(v.shape)} do not fit the cache {tuple(k_cache.shape)} as "
            "[T, Hkv, D]"
        )
    if slots.shape != (k.shape[0],):
        raise ValueError(f"write_kv: slots has shape {tuple(slots.shape)}, expected ({k.shape[0]},)")
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k, v = common.last_dim_contiguous(k), common.last_dim_contiguous(v)
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("write_kv: caches must share strides with a contiguous last dim (KVCache's layout)")
    block_t = 16
    dim = k.shape[2]
    _write_kv_kernel[(-(-num_tokens // block_t), k.shape[1])](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        num_tokens,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        HEAD_DIM=dim,
        BLOCK_D=common.next_pow2(dim),
        BLOCK_T=block_t,
    )
