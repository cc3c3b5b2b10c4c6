"""Paged prefill / chunked prefill: a chunk of new queries against its cached context and itself.

Sequences of one forward have different context and query lengths (varlen). The host cuts every
sequence's chunk into tiles of BLOCK_M query tokens and lists the tiles, so the grid is exactly
(number of tiles, KV heads): no program is launched for padding, however uneven the lengths.
One program takes BLOCK_M query tokens times the GQA group's query heads as the rows of its
tiles (row r is token r // BLOCK_G, query head r % BLOCK_G of the group), so each K/V tile is
loaded once per group.

The keys come in two phases with one online softmax:
1. the context before the chunk (positions [0, context_len - query_len)), read from the paged
   cache through the block table; every query of the chunk sees all of it, so no mask beyond
   the length is needed;
2. the chunk's own keys, read from the contiguous k_new/v_new rows, with the causal mask
   (key j visible to query i iff j <= i), and only up to the tile's last query.
Scores, softmax and the accumulator are float32; exponentials are base 2 (the softmax scale
times log2(e) multiplies the scores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serve.attention import triton_common as common
from serve.attention.triton_common import round_to

LOG2E = 1.4426950408889634


@triton.jit
def _softmax_step(q, k, v, s_ok, qk_scale, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One online-softmax update of (m_i, l_i, acc) with the key/value tile k, v [N, D].

    The scale multiplies the scores, not q: q stays exactly representable for tf32 dots.
    """
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(s_ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen no visible key yet (sliding window) keeps m = -inf: subtract 0 instead,
    # so that its alpha and p are 0 rather than NaN
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_new_ptr,
    v_new_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    tile_seq_ptr,
    tile_start_ptr,
    q_starts_ptr,
    q_lens_ptr,
    context_lens_ptr,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ch,
    stride_cs,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (query tile, KV head): BLOCK_M tokens x the group's heads against prefix + chunk."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    m0 = tl.load(tile_start_ptr + tile)
    q_start = tl.load(q_starts_ptr + seq).to(tl.int64)
    q_len = tl.load(q_lens_ptr + seq)
    prefix = tl.load(context_lens_ptr + seq) - q_len

    r = tl.arange(0, BLOCK_M * BLOCK_G)
    qi = m0 + r // BLOCK_G  # query index within the chunk
    heads = kv_head * GROUP + r % BLOCK_G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    row_ok = (qi < q_len) & (r % BLOCK_G < GROUP)
    q_off = (q_start + qi)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)

    cache_head = kv_head.to(tl.int64) * stride_ch
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(0, prefix, BLOCK_N):  # phase 1: cached context, fully visible
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < prefix
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_off = cache_head + (block * BLOCK_SIZE + n % BLOCK_SIZE)[:, None] * stride_cs + d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        seen = n_ok[None, :] & ((window <= 0) | (n[None, :] > (prefix + qi)[:, None] - window))
        m_i, l_i, acc = _softmax_step(q, k, v, seen, qk_scale, m_i, l_i, acc, PRECISION)

    hi = tl.minimum(m0 + BLOCK_M, q_len)
    for j0 in range(0, hi, BLOCK_N):  # phase 2: the chunk itself, causal
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        tok = (q_start + j)[:, None]
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_new_ptr + tok * stride_kt + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0).to(
            tl.float32
        )
        v = tl.load(v_new_ptr + tok * stride_vt + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0).to(
            tl.float32
        )
        visible = j_ok[None, :] & (j[None, :] <= qi[:, None])
        visible = visible & ((window <= 0) | (j[None, :] > qi[:, None] - window))
        m_i, l_i, acc = _softmax_step(q, k, v, visible, qk_scale, m_i, l_i, acc, PRECISION)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padded rows saw nothing
    o_off = (q_start + qi)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, round_to(o, out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_prefill(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    tile_seq: torch.Tensor,
    tile_start: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    block_m: int,
    scale: float,
    window: int = 0,
) -> None:
    """Write attention of the listed query tiles into `out` [T, H, D].

    q/k_new/v_new are the flat token batch ([T, H, D] / [T, Hkv, D]); per sequence (index into
    block_tables): q_starts (first row), q_lens, context_lens (int32); per tile: tile_seq and
    tile_start (query index within the chunk, a multiple of block_m).
    """
    n_tiles = tile_seq.shape[0]
    if n_tiles == 0:
        return
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    block_g = common.next_pow2(group)
    if block_m * block_g < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m={block_m}: must be a power of two with block_m * group >= 16 (group {group})")
    _prefill_kernel[(n_tiles, kv_heads)](
        q,
        k_new,
        v_new,
        k_cache,
        v_cache,
        out,
        block_tables,
        tile_seq,
        tile_start,
        q_starts,
        q_lens,
        context_lens,
        scale * LOG2E,
        window,
        q.stride(0),
        q.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_G=block_g,
        HEAD_DIM=dim,
        BLOCK_D=common.next_pow2(dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=32,
        PRECISION=common.dot_precision(k_cache.dtype),
    )
