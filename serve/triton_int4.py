"""int4 dequant-GEMM in Triton for the GPTQ packed layout (quantize/FORMAT.md): y = x @ W^T.

The kernel reads the checkpoint tensors as they are stored, with no repacking:
- `qweight` int32 [K/8, N], input row i in bits 4*(i % 8) of word [i // 8, n];
- `qzeros`  int32 [G, N/8], output column n in bits 4*(n % 8) of word [g, n // 8], holding
  zero - 1 (GPTQ v1, `checkpoint_format="gptq"`) or the zero itself ("gptq_v2");
- `scales`  [G, N] and `g_idx` int32 [K], the group of every input row.
Grid (M tiles, N tiles); each program walks K in BLOCK_K steps, unpacks a [BLOCK_K, BLOCK_N]
tile of codes, looks up scale and zero per (row's group, column) through g_idx (so act-order
checkpoints need no permutation), dequantizes w = (q - zero) * scale in float32 and accumulates
x_tile @ w_tile in float32. float32 operands because bf16 `tl.dot` is wrong under the
interpreter, and float32 accumulation because K can be tens of thousands of products whose
bf16 running sum would lose the small ones.

On CPU serving uses torch's int4 kernel (serve/quant.py); this one is for CUDA and is tested
on CPU under TRITON_INTERPRET=1 against `serve.quant.gptq_dequantize` in float64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serve.attention import triton_common as common
from serve.attention.triton_common import round_to
from serve.quant import default_g_idx

ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}


@triton.jit
def _int4_gemm_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    g_idx_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wk,
    stride_zg,
    stride_sg,
    stride_om,
    ZERO_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y: dequantize BLOCK_K rows of W per step, fp32 accumulate."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    nibble_n = ((rn % 8) * 4)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(
            x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
        ).to(tl.float32)
        kn_ok = k_ok[:, None] & n_ok[None, :]
        words = tl.load(qweight_ptr + (rk // 8).to(tl.int64)[:, None] * stride_wk + rn[None, :], mask=kn_ok, other=0)
        q = (words >> ((rk % 8) * 4)[:, None]) & 0xF
        g = tl.load(g_idx_ptr + rk, mask=k_ok, other=0).to(tl.int64)
        zwords = tl.load(qzeros_ptr + g[:, None] * stride_zg + (rn // 8)[None, :], mask=kn_ok, other=0)
        zero = ((zwords >> nibble_n) & 0xF) + ZERO_OFFSET
        scale = tl.load(scales_ptr + g[:, None] * stride_sg + rn[None, :], mask=kn_ok, other=0.0).to(tl.float32)
        w = (q - zero).to(tl.float32) * scale
        acc += tl.dot(x, w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dst = rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out_ptr + dst, round_to(acc, out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def check_gptq_tensors(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor
) -> tuple[int, int]:
    """Shapes and dtypes of a 4-bit GPTQ linear agree with each other; returns (K, N)."""
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"qweight/qzeros must be int32 (GPTQ packing), got {qweight.dtype}/{qzeros.dtype}")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    groups = scales.shape[0]
    if scales.shape != (groups, n) or qzeros.shape != (groups, n // 8) or n % 8:
        raise ValueError(
            f"scales {tuple(scales.shape)} / qzeros {tuple(qzeros.shape)} do not match qweight {tuple(qweight.shape)}: "
            f"expected scales [G, {n}] and qzeros [G, {n // 8}] with N a multiple of 8"
        )
    if g_idx.shape != (k,) or g_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"g_idx must be int32 [{k}] (the group of every input row), got {g_idx.dtype} {tuple(g_idx.shape)}"
        )
    return k, n


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bias: torch.Tensor | None = None,
    checkpoint_format: str = "gptq",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] @ dequant(W)^T -> [..., N] in `out_dtype` (default x's dtype), fp32 accumulate.

    `g_idx` values are trusted to lie in [0, G): check them once per layer with
    `Int4TritonLinear` (or `check_g_idx`), not per call, since that would sync a GPU.
    """
    if checkpoint_format not in ZERO_OFFSET:
        raise ValueError(f"checkpoint_format={checkpoint_format!r} is not supported; use one of {tuple(ZERO_OFFSET)}")
    k, n = check_gptq_tensors(qweight, qzeros, scales, g_idx)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features but qweight packs {k}")
    common.check_device("int4_matmul", x, qweight, qzeros, scales, g_idx, *([bias] if bias is not None else []))
    lead = x.shape[:-1]
    x2 = common.last_dim_contiguous(x.reshape(-1, k))
    m = x2.shape[0]
    out = common.alloc((m, n), out_dtype or x.dtype, x.device)
    if m == 0:
        return out.reshape(*lead, n)
    block_m = 16 if m <= 16 else 32
    block_n, block_k = 64, 32
    _int4_gemm_kernel[(-(-m // block_m), -(-n // block_n))](
        x2,
        qweight,
        qzeros,
        scales,
        g_idx,
        bias if bias is not None else scales,
        out,
        m,
        n,
        k,
        x2.stride(0),
        qweight.stride(0),
        qzeros.stride(0),
        scales.stride(0),
        out.stride(0),
        ZERO_OFFSET=ZERO_OFFSET[checkpoint_format],
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION=common.dot_precision(x.dtype),
    )
    return out.reshape(*lead, n)


def check_g_idx(g_idx: torch.Tensor, groups: int, name: str = "g_idx") -> None:
    """Every input row's group exists; an out-of-range group would read past `scales`."""
    lo, hi = int(g_idx.min()), int(g_idx.max())
    if lo < 0 or hi >= groups:
        raise ValueError(f"{name} holds groups {lo}..{hi} but scales has {groups} groups; the checkpoint is malformed")


class Int4TritonLinear:
    """y = x W^T (+ b) for a GPTQ linear on CUDA, callable like serve.quant.Int4Linear.

    Keeps the checkpoint tensors as stored; `g_idx=None` means the default contiguous groups of
    `group_size` rows (-1: one group), act-order g_idx is used as given.
    """

    def __init__(
        self,
        qweight: torch.Tensor,
        qzeros: torch.Tensor,
        scales: torch.Tensor,
        g_idx: torch.Tensor | None,
        group_size: int,
        bias: torch.Tensor | None = None,
        checkpoint_format: str = "gptq",
    ) -> None:
        if checkpoint_format not in ZERO_OFFSET:
            raise ValueError(
                f"checkpoint_format={checkpoint_format!r} is not supported; use one of {tuple(ZERO_OFFSET)}"
            )
        k = qweight.shape[0] * 8
        if g_idx is None:
            size = k if group_size <= 0 else group_size
            if k % size:
                raise ValueError(
                    f"group_size {group_size} does not divide in_features {k}; pass the checkpoint's g_idx"
                )
            g_idx = default_g_idx(k, size).to(qweight.device)
        self.g_idx = g_idx.to(torch.int32)
        self.in_features, self.out_features = check_gptq_tensors(qweight, qzeros, scales, self.g_idx)
        check_g_idx(self.g_idx, scales.shape[0])
        self.qweight, self.qzeros, self.scales, self.bias = qweight, qzeros, scales, bias
        self.checkpoint_format = checkpoint_format

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Apply to x [..., K]; returns x's dtype."""
        return int4_matmul(x, self.qweight, self.qzeros, self.scales, self.g_idx, self.bias, self.checkpoint_format)
