"""serve's AVX2 small-batch kernels against independent references.

References: float64 matmuls on the same bf16 values (bf16 kernel); a brute-force nibble packer
and float64 dequantization (int4 layout and float kernel); the int8-activation kernel against a
float64 evaluation of its documented arithmetic (activations rounded per 32 features to
round(x / s_b) * s_b with s_b an integer multiple of one row scale, zero-point term on the exact
sums), written with loops and torch ops here, not with the kernel's code. Rows run past the
8-row chunk, K past the 32-wide blocks, and results must not depend on the thread count.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serve import cpu_kernels

pytestmark = pytest.mark.skipif(
    not torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512", "AMX")), reason="the kernels need AVX2"
)


def test_kernels_build_here() -> None:
    """CI machines have g++ and AVX2: the kernels must build, not silently fall back."""
    assert cpu_kernels.available()


def _spacing(ref: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(ref.abs().clamp(min=1e-30))) - 7)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 19])
@pytest.mark.parametrize("n, k", [(300, 96), (77, 200), (64, 37), (130, 1024)])
def test_bf16_kernel_is_float32_accumulation_of_bf16_values(rows: int, n: int, k: int) -> None:
    torch.manual_seed(rows * 1000 + k)
    w = torch.randn(n, k).bfloat16()
    x = torch.randn(rows, k).bfloat16()
    ref = x.double() @ w.double().T
    got32 = cpu_kernels.gemv_bf16(x, w, torch.float32).double()
    accumulation = k * 2.0**-23 * (x.double().abs() @ w.double().abs().T)
    assert bool(((got32 - ref).abs() <= accumulation + 1e-30).all())
    got = cpu_kernels.gemv_bf16(x, w)  # rounded once to bf16
    assert got.dtype == torch.bfloat16
    assert bool(((got.double() - ref).abs() <= _spacing(ref) + accumulation).all())
    assert torch.equal(cpu_kernels.gemv_bf16(x.float(), w, torch.float32), got32.float())  # float32 input, same values


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("n, k", [(300, 96), (77, 200), (64, 37), (90, 2816)])  # 2816: features walked in chunks
def test_f32_kernel_is_float32_accumulation(rows: int, n: int, k: int) -> None:
    """float32 weights read in place: the exact product within float32 accumulation error, in
    float32 or rounded once to bf16."""
    torch.manual_seed(rows * 100 + k)
    w, x = torch.randn(n, k), torch.randn(rows, k)
    ref = x.double() @ w.double().T
    accumulation = k * 2.0**-23 * (x.double().abs() @ w.double().abs().T)
    got = cpu_kernels.gemv_f32(x, w).double()
    assert bool(((got - ref).abs() <= accumulation + 1e-30).all())
    rounded = cpu_kernels.gemv_f32(x.bfloat16(), w, torch.bfloat16)
    ref16 = x.bfloat16().double() @ w.double().T
    assert bool(((rounded.double() - ref16).abs() <= _spacing(ref16) + accumulation).all())


def _brute_pack(q: torch.Tensor) -> torch.Tensor:
    """q int [K, N] -> uint8 [N, K/2]: block b's byte j = q[32b+j] | q[32b+16+j] << 4, by loops."""
    k, n = q.shape
    out = torch.zeros(n, k // 2, dtype=torch.uint8)
    for o in range(n):
        for b in range(k // 32):
            for j in range(16):
                out[o, b * 16 + j] = int(q[32 * b + j, o]) | (int(q[32 * b + 16 + j, o]) << 4)
    return out


def _random_int4(k: int, n: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    scales = torch.rand(k // group, n, generator=g) * 0.05 + 0.01
    zeros = torch.randn(k // group, n, generator=g) * 0.05
    return q, scales, zeros


def _dequant64(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """w [N, K] = (q - 8) * scale + zero, torch's int4 convention, in float64."""
    s, z = scales.double().repeat_interleave(group, 0), zeros.double().repeat_interleave(group, 0)
    return ((q.double() - 8) * s + z).T


def test_int4_layout_matches_brute_force_packing() -> None:
    q, scales, zeros = _random_int4(96, 5, 32, seed=1)
    packed = cpu_kernels.Int4Packed(q, scales, zeros, 32)
    assert torch.equal(packed.q, _brute_pack(q))
    assert torch.allclose(packed.zeros.double(), (zeros.double() - 8 * scales.double()).T, atol=1e-7)


@pytest.mark.parametrize("rows", [1, 3, 8, 11])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_float_kernel_matches_float64_dequantized(rows: int, group: int) -> None:
    q, scales, zeros = _random_int4(256, 72, group, seed=rows + group)
    x = torch.randn(rows, 256)
    ref = x.double() @ _dequant64(q, scales, zeros, group).T
    got = cpu_kernels.gemv_int4(x, cpu_kernels.Int4Packed(q, scales, zeros, group), torch.float32).double()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def _int8_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """x rounded per 32 features to round(x / s_b) * s_b (float64, loops), where each block's
    scale is an integer multiple of one row scale: S = max_b a_b / (127 M), m_b = ceil(a_b / (127
    S)), s_b = S m_b, for a block's max |x| a_b and M = min(4096, 2^23 / group). S and m_b are
    computed in float32, as the kernel does (ties of the ceiling must go the same way)."""
    mult_range = max(1, min(4096, 2**23 // group))
    out = torch.zeros(x.shape, dtype=torch.float64)
    for r in range(x.shape[0]):
        amax = x[r].float().reshape(-1, 32).abs().amax(dim=1)
        row_scale = amax.max() / (127.0 * mult_range)
        for b in range(x.shape[1] // 32):
            blk = x[r, 32 * b : 32 * (b + 1)].double()
            m = torch.ceil(amax[b] / (127.0 * row_scale)).clamp(max=mult_range) if row_scale > 0 else 0.0
            s = float(row_scale * m) if row_scale > 0 else 0.0
            out[r, 32 * b : 32 * (b + 1)] = (torch.round(blk / s).clamp(-127, 127) * s) if s > 0 else 0.0
    return out


@pytest.mark.parametrize("rows", [1, 2, 8, 9])
@pytest.mark.parametrize("group, k", [(32, 256), (32, 224), (64, 320), (64, 1152), (128, 256), (128, 640), (256, 512)])
def test_int4_int8_activation_kernel_matches_its_arithmetic(rows: int, group: int, k: int) -> None:
    """q * scale terms use the rounded activations, the zero term the exact ones.

    Group 32 or K not a multiple of 64 take the one-block kernel, the rest the two-block one (an
    odd number of pairs per group at 64, group counts on both sides of 8 for the zero term).
    """
    torch.manual_seed(1000 * rows + k)  # the ~1% bound below is a statistic: a fixed draw
    q, scales, zeros = _random_int4(k, 40, group, seed=7 * rows + group)
    x = torch.randn(rows, k) * torch.linspace(0.1, 3, k)  # uneven magnitudes across blocks
    x[0, :32] = 0.0  # an all-zero block must not divide by zero
    x[-1, -32:] *= 1e-4  # a block far below the row's largest: a multiplier of 1
    s, z = scales.double().repeat_interleave(group, 0), zeros.double().repeat_interleave(group, 0)
    ref = _int8_rows(x, group) @ (q.double() * s) + x.double() @ (z - 8 * s)
    packed = cpu_kernels.Int4Packed(q, scales, zeros, group)
    got = cpu_kernels.gemv_int4(x, packed, torch.float32, int8_activations=True).double()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    exact = x.double() @ _dequant64(q, scales, zeros, group).T  # and the rounding costs ~1%
    assert ((got - exact).norm() / exact.norm()).item() < 0.03


def test_int8_activation_sums_do_not_overflow_at_the_extremes() -> None:
    """All weights 15, all activations at the same magnitude (every m_b = M, every |x_q| = 127)
    over a large group: the int32 group sums reach their bound and must stay exact."""
    k, group = 4096, 4096
    q = torch.full((k, 8), 15, dtype=torch.int32)
    scales, zeros = torch.full((1, 8), 0.01), torch.zeros(1, 8)
    x = torch.full((2, k), 3.0)
    x[1] *= -1
    packed = cpu_kernels.Int4Packed(q, scales, zeros, group)
    ref = x.double() @ _dequant64(q, scales, zeros, group).T
    got = cpu_kernels.gemv_int4(x, packed, torch.float32, int8_activations=True).double()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=0.0)


def test_results_do_not_depend_on_thread_count() -> None:
    q, scales, zeros = _random_int4(512, 700, 128, seed=3)
    packed = cpu_kernels.Int4Packed(q, scales, zeros, 128)
    w = torch.randn(700, 512).bfloat16()
    x = torch.randn(5, 512).bfloat16()
    before = torch.get_num_threads()
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        results.append(
            (
                cpu_kernels.gemv_bf16(x, w),
                cpu_kernels.gemv_int4(x, packed),
                cpu_kernels.gemv_int4(x, packed, int8_activations=True),
            )
        )
    torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_kernels_really_run_on_torchs_threads() -> None:
    """Built without OpenMP, at::parallel_for's pragma is ignored and every kernel runs on one
    core whatever torch.set_num_threads says (decode then ran 1.5x slower on this 2-core host)."""
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert cpu_kernels.load().parallel_threads() == threads
    finally:
        torch.set_num_threads(before)


def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("hidden", [64, 96, 1024, 2048])
def test_rms_norm_bf16_matches_transformers_formula(hidden: int) -> None:
    """Within one bf16 step of transformers' formula and nearly always equal: only the order of
    the float32 sum of squares differs."""
    torch.manual_seed(hidden)
    x, w = (torch.randn(9, hidden) * 4).bfloat16(), torch.randn(hidden).bfloat16()
    got, ref = cpu_kernels.rms_norm_bf16(x, w, 1e-6), _hf_rms_norm(x, w, 1e-6)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    ulps = (got.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    assert int(ulps.max()) <= 1
    assert (got == ref).float().mean().item() > 0.999


def test_bad_shapes_are_named_errors() -> None:
    q, scales, zeros = _random_int4(96, 8, 32, seed=0)
    with pytest.raises(ValueError, match="group size"):
        cpu_kernels.Int4Packed(q, scales, zeros, 48)
    packed = cpu_kernels.Int4Packed(q, scales, zeros, 32)
    with pytest.raises(RuntimeError, match=r"x must be \[rows, 96\]"):
        cpu_kernels.gemv_int4(torch.randn(2, 64), packed)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_kernels.gemv_bf16(torch.randn(2, 8), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.gemv_f32(torch.randn(2, 8), torch.randn(4, 8).bfloat16())


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path: Path) -> None:
    import os
    import time

    from serve.cpu_kernels import clear_stale_lock

    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_stale_lock(tmp_path, max_age=600) and lock.exists()  # a build may hold it
    old = time.time() - 3600
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path, max_age=600) and not lock.exists()
    assert not clear_stale_lock(tmp_path, max_age=600)  # nothing to remove
