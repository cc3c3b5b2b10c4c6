"""Paged-attention decode (one query token per sequence), flash-decoding style.

Grid of the first kernel: (sequence, KV head, partition). A partition is `partition_size`
consecutive context positions; one program streams its keys and values block by block through
the block table with an online softmax, for all query heads that share its KV head at once
(GQA: the group's query heads are the rows of one `tl.dot`, so each K/V tile is loaded once per
group instead of once per query head). With one partition per sequence the program normalises
and writes the output directly; otherwise it writes its partial output (already divided by its
own sum of exponentials) and its log-sum-exp, and a second kernel, grid (sequence, KV head),
merges the partitions of the group's query heads:
    out = sum_p exp(lse_p - m) * o_p / sum_p exp(lse_p - m),  m = max_p lse_p.

Why split: at decode time there is one query row per head, so a grid of (sequence, head) alone
leaves most of a GPU idle for small batches of long contexts; partitions add parallelism along
the context. Exponentials are base 2 (the softmax scale times log2(e) multiplies the scores,
after the dot, so the float32-upcast q stays exact for tf32 dots); everything after the loads
runs in float32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from serve.attention import triton_common as common
from serve.attention.triton_common import round_to

LOG2E = 1.4426950408889634


@triton.jit
def _decode_partition_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    q_rows_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_ch,
    stride_cs,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_pp,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (sequence, KV head, partition): online softmax over at most PARTITION positions."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    start = part * PARTITION
    lo = 0  # first key position the query sees (sliding window; 0 without one)
    if window > 0:
        lo = tl.maximum(ctx - window, 0)
    if start < ctx:
        end = tl.minimum(start + PARTITION, ctx)
        row = tl.load(q_rows_ptr + seq).to(tl.int64)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + g
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        q = tl.load(
            q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=g_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        cache_head = kv_head.to(tl.int64) * stride_ch
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        # start at the tile holding `lo`: every tile visited has a visible key, so m_i stays finite;
        # a partition wholly before the window visits none and merges with weight 0
        first = tl.maximum(start, lo - lo % BLOCK_N)
        for n0 in range(first, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = (n < end) & (n >= lo)
            block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            slot = block * BLOCK_SIZE + n % BLOCK_SIZE
            kv_off = cache_head + slot[:, None] * stride_cs + d[None, :]
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # scale after: tf32-exact
            s = tl.where(n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m_i = m_new
        l_i = tl.where(l_i > 0, l_i, 1.0)  # a partition before the window: o = 0, lse = -inf
        o = acc / l_i[:, None]
        if SPLIT:
            dst = seq.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + part * stride_pp + d[None, :]
            tl.store(part_out_ptr + dst, o, mask=g_ok[:, None] & d_ok[None, :])
            lse = m_i + tl.log2(l_i)
            tl.store(part_lse_ptr + seq.to(tl.int64) * stride_lb + heads * stride_lh + part, lse, mask=g_ok)
        else:
            dst = row * stride_ot + heads[:, None] * stride_oh + d[None, :]
            tl.store(out_ptr + dst, round_to(o, out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_merge_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    context_lens_ptr,
    q_rows_ptr,
    stride_ot,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_pp,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION: tl.constexpr,
    MAX_PARTS: tl.constexpr,
):
    """One (sequence, KV head): log-sum-exp merge of the partitions of the group's query heads."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + seq)
    n_parts = (ctx + PARTITION - 1) // PARTITION
    g = tl.arange(0, BLOCK_G)
    p = tl.arange(0, MAX_PARTS)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    gp_ok = (g < GROUP)[:, None] & (p < n_parts)[None, :]
    lse_off = seq.to(tl.int64) * stride_lb + heads[:, None] * stride_lh + p[None, :]
    lse = tl.load(part_lse_ptr + lse_off, mask=gp_ok, other=float("-inf"))
    top = tl.max(lse, 1)
    top = tl.where(g < GROUP, top, 0.0)  # padded heads: avoid -inf - -inf
    w = tl.where(gp_ok, tl.exp2(lse - top[:, None]), 0.0)
    o_off = (
        seq.to(tl.int64) * stride_pb
        + heads[:, None, None] * stride_ph
        + p[None, :, None] * stride_pp
        + d[None, None, :]
    )
    d_ok = d < HEAD_DIM
    o = tl.load(part_out_ptr + o_off, mask=gp_ok[:, :, None] & d_ok[None, None, :], other=0.0)
    denom = tl.sum(w, 1)
    denom = tl.where(g < GROUP, denom, 1.0)
    merged = tl.sum(o * w[:, :, None], 1) / denom[:, None]
    row = tl.load(q_rows_ptr + seq).to(tl.int64)
    dst = row * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + dst, round_to(merged, out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None] & d_ok[None, :])


def decode_block_n(partition: int) -> int:
    """Keys per inner iteration: up to 64, dividing the partition, at least 16 (tl.dot's minimum).

    Keys are gathered per position through the block table, so the tile does not have to match
    the cache block size (any block size works, also blocks smaller than 16).
    """
    return math.gcd(partition, 64)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    q_rows: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    block_size: int,
    scale: float,
    partition_size: int,
    window: int = 0,
) -> None:
    """Write attention of the query rows `q_rows` [B] of q [T, H, D] into the same rows of `out`.

    k_cache/v_cache are one layer's [Hkv, slots, D]; block_tables [B, max_blocks] int32,
    context_lens [B] int32 (positions attended, including the query's own). `max_context_len`
    is passed from the host so that sizing the grid never reads a device tensor.
    """
    batch = q_rows.shape[0]
    if batch == 0:
        return
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    if partition_size % 16 or partition_size <= 0:
        raise ValueError(f"partition_size must be a positive multiple of 16, got {partition_size}")
    partition = partition_size
    block_n = decode_block_n(partition)
    n_parts = -(-max_context_len // partition)
    split = n_parts > 1
    device = q.device
    if split:
        part_out = common.alloc((batch, heads, n_parts, dim), torch.float32, device)
        part_lse = common.alloc((batch, heads, n_parts), torch.float32, device)
    else:  # never read: the kernel writes `out` directly
        part_out = part_lse = out
    pos = part_out.stride() if split else (0, 0, 0, 0)
    lss = part_lse.stride() if split else (0, 0, 0)
    _decode_partition_kernel[(batch, kv_heads, n_parts)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        q_rows,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        window,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        pos[0],
        pos[1],
        pos[2],
        lss[0],
        lss[1],
        GROUP=group,
        BLOCK_G=max(16, common.next_pow2(group)),
        HEAD_DIM=dim,
        BLOCK_D=common.next_pow2(dim),
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        PARTITION=partition,
        SPLIT=split,
        PRECISION=common.dot_precision(k_cache.dtype),
    )
    if split:
        _decode_merge_kernel[(batch, kv_heads)](
            out,
            part_out,
            part_lse,
            context_lens,
            q_rows,
            out.stride(0),
            out.stride(1),
            pos[0],
            pos[1],
            pos[2],
            lss[0],
            lss[1],
            GROUP=group,
            BLOCK_G=common.next_pow2(group),
            HEAD_DIM=dim,
            BLOCK_D=common.next_pow2(dim),
            PARTITION=partition,
            MAX_PARTS=common.next_pow2(n_parts),
        )
