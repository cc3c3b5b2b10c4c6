"""Packing integer codes into the GPTQ (v1) and AWQ-GEMM checkpoint tensors (FORMAT.md).

GPTQ packs a little-endian bit stream along one dimension: value ``j`` occupies bits
``j*bits .. j*bits+bits-1`` of the stream, word ``k`` holds stream bits ``32k .. 32k+31`` (so
for 4 and 8 bits each int32 holds whole values, lowest nibble first; 3-bit values may straddle
two words, as AutoGPTQ's 3-bit layout does). AWQ-GEMM packs 8 output columns per int32 with
its interleaved nibble order. Both are vectorised here; tests check them against loops.
"""

from __future__ import annotations

import torch

from quantize.quantizer import QuantizedLinear

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Reinterpret unsigned 32-bit values held in int64 as int32 (two's complement)."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_bitstream(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``values[n, m]`` (0 .. 2**bits-1) along dim 0 into int32 ``[n*bits/32, m]``."""
    n = values.shape[0]
    if (n * bits) % 32:
        raise ValueError(f"pack: {n} values of {bits} bits do not fill whole int32 words")
    v = values.to(torch.int64) & (2**bits - 1)
    pos = torch.arange(n, dtype=torch.int64) * bits
    word, shift = pos // 32, pos % 32
    out = torch.zeros(n * bits // 32 + 1, values.shape[1], dtype=torch.int64)
    out.index_add_(0, word, (v << shift[:, None]) & 0xFFFFFFFF)
    spill = (shift + bits) > 32
    if spill.any():
        rows = spill.nonzero().squeeze(1)
        out.index_add_(0, word[rows] + 1, v[rows] >> (32 - shift[rows])[:, None])
    return _to_int32(out[:-1])


def unpack_bitstream(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bitstream`: int64 values ``[n, m]``."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = torch.cat([w, torch.zeros_like(w[:1])])
    pos = torch.arange(n, dtype=torch.int64) * bits
    word, shift = pos // 32, (pos % 32)[:, None]
    low = w[word] >> shift
    high = (w[word + 1] << (32 - shift)) & 0xFFFFFFFF
    return (low | high) & (2**bits - 1)


def pack_gptq(ql: QuantizedLinear) -> dict[str, torch.Tensor]:
    """GPTQ v1 tensors: qweight ``[in*b/32, out]``, qzeros ``[G, out*b/32]`` (zero - 1),
    scales fp16 ``[G, out]``, g_idx int32 ``[in]`` (a bias is written by export, as is)."""
    zeros_minus_one = (ql.zeros.t().to(torch.int64) - 1) & (2**ql.bits - 1)
    out = {
        "qweight": pack_bitstream(ql.codes.t(), ql.bits),
        "qzeros": pack_bitstream(zeros_minus_one.t(), ql.bits).t().contiguous(),
        "scales": ql.scales.t().contiguous().half(),
        "g_idx": ql.g_idx.to(torch.int32).clone(),
    }
    return out


def _awq_pack_columns(values: torch.Tensor) -> torch.Tensor:
    """Pack ``values[r, c]`` (4-bit) 8 columns per int32 in AWQ's interleaved order."""
    r, c = values.shape
    if c % 8:
        raise ValueError(f"pack: AWQ packs 8 columns per int32; {c} columns is not a multiple of 8")
    v = values.to(torch.int64).reshape(r, c // 8, 8)[:, :, list(AWQ_ORDER)] & 0xF
    shifts = torch.arange(8, dtype=torch.int64) * 4
    return _to_int32((v << shifts).sum(dim=-1))


def pack_awq(ql: QuantizedLinear) -> dict[str, torch.Tensor]:
    """AWQ-GEMM tensors: qweight ``[in, out/8]``, qzeros ``[G, out/8]`` (zero as is), scales fp16."""
    if ql.bits != 4:
        raise ValueError(f"pack: the AWQ GEMM format holds 4-bit weights only, got bits={ql.bits}")
    trivial = torch.arange(ql.codes.shape[1], dtype=torch.int32) // ql.group_size
    if not torch.equal(ql.g_idx.to(torch.int32), trivial):
        raise ValueError("pack: the AWQ format has no g_idx; act-order groups need the GPTQ format")
    out = {
        "qweight": _awq_pack_columns(ql.codes.t()),
        "qzeros": _awq_pack_columns(ql.zeros.t()),
        "scales": ql.scales.t().contiguous().half(),
    }
    return out
