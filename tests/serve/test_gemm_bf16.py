"""serve's small-batch bf16 GEMM (csrc/gemm_bf16.cpp) against float64, and where DenseLinear uses it.

Reference: a float64 matmul of the same bf16 values (plus the float32 bias); the kernel's float32
sums may differ from it by float32 accumulation error (products exact, each add rounded: the K/32
vector adds per lane, the 16-lane sum and the bias), then one bf16 rounding. Shapes cover every
row-group size (1-6 rows, and the even split of 7-13, 33, 128), weight rows past the 4-row tiles
(N % 4), and K past the 32-wide blocks. It runs only in the avx512_bf16 and amx variants; the
others refuse it by name, and DenseLinear never calls it there.
"""

from __future__ import annotations

import pytest
import torch

from serve import cpu_kernels
from serve.quant import NATIVE_BF16_GEMM_MAX_ROWS, NATIVE_BF16_KERNEL_MAX_ROWS, DenseLinear

BF16_DOT = "avx512_bf16"
missing = sorted(set(cpu_kernels.ISA_FLAGS[BF16_DOT]) - cpu_kernels.cpu_flags())
needs_bf16_dot = pytest.mark.skipif(bool(missing), reason=f"this CPU lacks {', '.join(missing)}")


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 x @ w.T (+ bias) and the float32 accumulation bound of the kernel's sum."""
    ref = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    if bias is not None:
        ref, mag = ref + bias.double(), mag + bias.double().abs()
    k = x.shape[1]
    return ref, (k / 16 + 8) * 2.0**-23 * mag  # per lane k/32 blocks of 2 adds, the lane sum, the bias


def _spacing(ref: torch.Tensor) -> torch.Tensor:
    """One bf16 step at each value (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(ref.abs().clamp(min=1e-30))) - 7)


@needs_bf16_dot
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 11, 13, 33, 128])
@pytest.mark.parametrize("n, k", [(300, 96), (77, 200), (7, 37), (130, 1024), (64, 2048)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_is_float32_accumulation_rounded_once(rows: int, n: int, k: int, with_bias: bool) -> None:
    torch.manual_seed(rows * 7919 + n * 31 + k)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(rows, k).bfloat16()
    bias = torch.randn(n) if with_bias else None
    with cpu_kernels.use_isa(BF16_DOT):
        got = cpu_kernels.gemm_bf16_rows(x, w, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    ref, accumulation = _reference(x, w, bias)
    assert bool(((got.double() - ref).abs() <= _spacing(ref) + accumulation).all())


@needs_bf16_dot
def test_gemm_gives_the_same_bits_on_any_thread_count() -> None:
    torch.manual_seed(0)
    w, x = torch.randn(1000, 640).bfloat16(), torch.randn(33, 640).bfloat16()
    threads = torch.get_num_threads()
    with cpu_kernels.use_isa(BF16_DOT):
        try:
            torch.set_num_threads(1)
            one = cpu_kernels.gemm_bf16_rows(x, w)
            torch.set_num_threads(2)
            two = cpu_kernels.gemm_bf16_rows(x, w)
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_gemm_is_refused_by_name_without_bf16_dot_products() -> None:
    w, x = torch.randn(8, 32).bfloat16(), torch.randn(5, 32).bfloat16()
    with cpu_kernels.use_isa("avx2"), pytest.raises(RuntimeError, match="needs the avx512_bf16 or amx variant"):
        cpu_kernels.gemm_bf16_rows(x, w)


@needs_bf16_dot
def test_gemm_names_bad_inputs() -> None:
    w, x = torch.randn(8, 32).bfloat16(), torch.randn(5, 32).bfloat16()
    cases = [
        ((x.float(), w, None), "x must be a contiguous bf16"),
        ((x, torch.randn(8, 16).bfloat16(), None), "w must be a contiguous bf16 \\[N, K\\] tensor with x's K"),
        ((x, w, torch.randn(7)), "bias must be float32 \\[N\\]"),
    ]
    with cpu_kernels.use_isa(BF16_DOT):
        for args, message in cases:
            with pytest.raises(RuntimeError, match=message):
                cpu_kernels.gemm_bf16_rows(*args)


@needs_bf16_dot
def test_dense_linear_takes_the_gemm_between_the_one_row_kernel_and_onednn() -> None:
    torch.manual_seed(1)
    w, b = torch.randn(96, 640).bfloat16(), torch.randn(96).bfloat16()
    with cpu_kernels.use_isa(BF16_DOT):
        lin = DenseLinear(w, b)
        assert lin.gemm_max_rows == NATIVE_BF16_GEMM_MAX_ROWS
        for rows in (NATIVE_BF16_KERNEL_MAX_ROWS + 1, 33, NATIVE_BF16_GEMM_MAX_ROWS):
            x = torch.randn(2, rows // 2, 640).bfloat16() if rows % 2 == 0 else torch.randn(rows, 640).bfloat16()
            want = cpu_kernels.gemm_bf16_rows(x.reshape(rows, 640), lin.weight, b.float()).reshape(*x.shape[:-1], 96)
            assert torch.equal(lin(x), want)
        x = torch.randn(NATIVE_BF16_GEMM_MAX_ROWS + 1, 640).bfloat16()  # oneDNN's prepacked GEMM above
        ref, accumulation = _reference(x, w, b.float())
        got = lin(x).double()
        assert bool(((got - ref).abs() <= _spacing(ref) + accumulation).all())
    with cpu_kernels.use_isa("avx2"):
        assert DenseLinear(w, b).gemm_max_rows == 0  # no bf16 dot products: oneDNN (or the float32 copy)


@pytest.mark.skipif("amx" not in cpu_kernels.supported_isas(), reason="this CPU does not run the amx variant")
def test_amx_keeps_tile_gemms_and_onednn_for_every_batch_past_the_one_row_kernel() -> None:
    torch.manual_seed(2)
    with cpu_kernels.use_isa("amx"):
        fits, odd = DenseLinear(torch.randn(96, 640).bfloat16()), DenseLinear(torch.randn(100, 640).bfloat16())
        assert fits.amx is not None and odd.amx is None and odd.packed is not None
        assert fits.gemm_max_rows == odd.gemm_max_rows == 0  # tiles win from 5 rows on an amx CPU
        x = torch.randn(33, 640).bfloat16()
        assert torch.equal(fits(x), cpu_kernels.amx_linear(x, fits.amx))
