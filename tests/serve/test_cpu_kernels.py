"""serve's small-batch CPU kernels against independent references, in every ISA variant.

References: float64 matmuls on the same bf16 values (bf16 kernel); a brute-force nibble packer
and float64 dequantization (int4 layout and float kernel); the int8-activation kernel against a
float64 evaluation of its documented arithmetic (activations rounded per 32 features to
round(x / s_b) * s_b with s_b an integer multiple of one row scale, zero-point term on the exact
sums), written with loops and torch ops here, not with the kernel's code. Rows run past the
8-row chunk, K past the 32-wide blocks, and results must not depend on the thread count.

Each kernel test runs once per ISA variant (`isa` fixture): avx2 everywhere, the AVX-512 ones
wherever the CPU reports their flags (skipped, naming the missing flags, only where it does not).
The avx512_bf16 variant multiplies bf16 activations with vdpbf16ps: its products are exact and its
float32 adds round as FMAs do, so the same float32-accumulation bound applies to it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from serve import cpu_kernels

pytestmark = pytest.mark.skipif(
    not torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512", "AMX")), reason="the kernels need AVX2"
)


def _isa_param(name: str) -> object:
    missing = sorted(set(cpu_kernels.ISA_FLAGS[name]) - cpu_kernels.cpu_flags())
    reason = f"this CPU lacks {', '.join(missing)}"
    return pytest.param(name, id=name, marks=pytest.mark.skipif(bool(missing), reason=reason))


@pytest.fixture(params=[_isa_param(name) for name in cpu_kernels.ISAS])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each ISA variant of the matrix products in turn (the loaded one is restored after)."""
    with cpu_kernels.use_isa(request.param):
        yield request.param


def test_kernels_build_here() -> None:
    """CI machines have g++ and AVX2: the kernels must build, not silently fall back."""
    assert cpu_kernels.available()


def test_the_cpus_best_variant_is_chosen_unless_the_environment_names_one() -> None:
    assert cpu_kernels.isa() == cpu_kernels.select_isa()  # loaded under this environment
    if not os.environ.get(cpu_kernels.ISA_ENV):
        assert cpu_kernels.isa() == cpu_kernels.supported_isas()[-1]
        flags = cpu_kernels.cpu_flags()
        if {"avx512f", "avx512_bf16", "avx512_vnni"} <= flags and "amx_tile" not in flags:  # e.g. Zen 4
            assert cpu_kernels.isa() == "avx512_bf16"
        if {"avx512_bf16", "amx_tile", "amx_bf16"} <= flags:  # Sapphire Rapids: AMX unless the OS refuses it
            assert cpu_kernels.isa() == ("amx" if cpu_kernels.load().amx_enable() else "avx512_bf16")
    env = {**os.environ, cpu_kernels.ISA_ENV: "avx2"}
    code = "from serve import cpu_kernels; print(cpu_kernels.isa())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "avx2"


def test_isa_selection_by_flags_and_bad_overrides() -> None:
    """The dispatch logic on made-up CPUs: AVX2-only (Zen 3), AVX-512 without VNNI (Skylake-X),
    with VNNI (Cascade Lake), with BF16 (Zen 4), with BF16 and AMX (Sapphire Rapids)."""
    avx2 = frozenset({"avx2", "fma", "f16c", "sse4_2"})
    skx = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
    clx = skx | {"avx512_vnni"}
    zen4 = clx | {"avx512_bf16"}
    spr = zen4 | {"amx_bf16", "amx_int8", "amx_tile"}
    assert cpu_kernels.select_isa(frozenset({"sse4_2"}), env="") is None
    assert cpu_kernels.select_isa(avx2, env="") == "avx2"
    assert cpu_kernels.select_isa(skx, env="") == "avx512"
    assert cpu_kernels.select_isa(clx, env="") == "avx512_vnni"
    assert cpu_kernels.select_isa(zen4, env="") == "avx512_bf16"
    assert cpu_kernels.select_isa(spr, env="") == "amx"
    assert cpu_kernels.select_isa(spr, env="avx512_bf16") == "avx512_bf16"
    assert cpu_kernels.select_isa(spr, env=" AVX2 ") == "avx2"
    assert cpu_kernels.supported_isas(spr)[-2:] == ("avx512_bf16", "amx")
    with pytest.raises(ValueError, match=r"WARSHA_CPU_ISA=amx: this CPU lacks amx_bf16, amx_tile"):
        cpu_kernels.select_isa(zen4, env="amx")
    assert cpu_kernels.supported_isas(clx) == ("avx2", "avx512", "avx512_vnni")
    with pytest.raises(ValueError, match=r"WARSHA_CPU_ISA='avx9'.*one of avx2, avx512"):
        cpu_kernels.select_isa(spr, env="avx9")
    with pytest.raises(
        ValueError, match=r"WARSHA_CPU_ISA=avx512_bf16: this CPU lacks avx512_bf16; it runs avx2, avx512"
    ):
        cpu_kernels.select_isa(clx, env="avx512_bf16")
    with pytest.raises(RuntimeError, match="unknown ISA"):
        cpu_kernels.load().set_isa("avx9")


def _spacing(ref: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(ref.abs().clamp(min=1e-30))) - 7)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 19])
@pytest.mark.parametrize("n, k", [(300, 96), (77, 200), (64, 37), (130, 1024)])
def test_bf16_kernel_is_float32_accumulation_of_bf16_values(rows: int, n: int, k: int, isa: str) -> None:
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
    got_f = cpu_kernels.gemv_bf16(x.float(), w, torch.float32)  # float32 input, same values
    if isa in ("avx512_bf16", "amx"):  # bf16 input took vdpbf16ps, float32 input the widening kernel
        assert bool(((got_f.double() - ref).abs() <= accumulation + 1e-30).all())
    else:
        assert torch.equal(got_f, got32.float())
    out = torch.full((rows, n), float("nan"))  # into the caller's float32 buffer: the same numbers
    assert cpu_kernels.gemv_bf16_out(x, w, out) is out and torch.equal(out, got.float())
    assert torch.equal(cpu_kernels.gemv_bf16_out(x, w, out, round_bf16=False), got32.float())


def test_bf16_kernel_into_a_buffer_names_a_wrong_buffer() -> None:
    w, x = torch.randn(64, 32).bfloat16(), torch.randn(2, 32).bfloat16()
    for bad in (torch.empty(2, 64, dtype=torch.bfloat16), torch.empty(3, 64), torch.empty(64, 2).T):
        with pytest.raises(RuntimeError, match=r"out must be a contiguous float32 \[2, 64\] tensor"):
            cpu_kernels.gemv_bf16_out(x, w, bad)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("n, k", [(300, 96), (77, 200), (64, 37), (90, 2816)])  # 2816: features walked in chunks
def test_f32_kernel_is_float32_accumulation(rows: int, n: int, k: int, isa: str) -> None:
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
def test_int4_float_kernel_matches_float64_dequantized(rows: int, group: int, isa: str) -> None:
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
@pytest.mark.parametrize(
    "group, k", [(32, 256), (32, 224), (64, 320), (64, 1152), (128, 256), (128, 640), (256, 512), (512, 1536)]
)
def test_int4_int8_activation_kernel_matches_its_arithmetic(rows: int, group: int, k: int, isa: str) -> None:
    """q * scale terms use the rounded activations, the zero term the exact ones.

    Group 32 or K not a multiple of 64 take the one-block kernel, groups of 64 the two-block one
    (an odd number of pairs per group), groups of 128 and more the four-block one on the 512-bit
    VNNI variants (one, two and four steps per group) and the two-block one elsewhere; group
    counts on both sides of 8 for the zero term.
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


def test_int8_activation_sums_do_not_overflow_at_the_extremes(isa: str) -> None:
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


def test_results_do_not_depend_on_thread_count(isa: str) -> None:
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


@pytest.mark.parametrize("hidden", [13, 64, 96, 100, 1024, 2048])
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


def _int16_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded per row to S * round(x / S), S = max|x| / 32767, computed in float32 as the
    512-bit VNNI int8 kernel does (half to even); float64 out."""
    x = x.float()
    s = x.abs().amax(dim=1, keepdim=True) / 32767.0
    q = torch.round(x / torch.where(s > 0, s, torch.ones_like(s))).clamp(-32767, 32767)
    return torch.where(s > 0, q, torch.zeros_like(q)).double() * s.double()


def _int8_input(x: torch.Tensor) -> torch.Tensor:
    """The activations gemv_int8 multiplies here: int16-rounded rows where it rounds them."""
    return _int16_rows(x) if cpu_kernels.int8_rounds_activations(x.shape[1]) else x.double()


@pytest.mark.parametrize("k", [200, 640, 8200])  # 8200: past the int16 path's reach, widened on every variant
def test_int8_weight_kernel_matches_float64(k: int, isa: str) -> None:
    torch.manual_seed(5 + k)
    q = torch.randint(-127, 128, (301, k), dtype=torch.int8)
    scale = torch.rand(301) * 0.01 + 1e-3
    x = torch.randn(3, k)
    x[1] *= 1e-3  # rows of different magnitudes: one scale per row
    x[2, 7] = 40.0  # one large value: the other features of the row round coarser
    xin = _int8_input(x)
    assert cpu_kernels.int8_rounds_activations(k) == (isa in ("avx512_vnni", "avx512_bf16", "amx") and k <= 8192)
    ref = xin @ (q.double() * scale.double()[:, None]).T
    got = cpu_kernels.gemv_int8(x, q, scale, torch.float32).double()
    accumulation = k * 2.0**-23 * (xin.abs() @ (q.double().abs() * scale.double()[:, None]).T)
    assert bool(((got - ref).abs() <= 2 * accumulation + 1e-30).all())
    exact = x.double() @ (q.double() * scale.double()[:, None]).T  # what the int16 rounding costs:
    error = (got - exact).norm(dim=1) / exact.norm(dim=1)  # ~1e-5, ~1e-4 beside a 40x outlier
    assert error[:2].max().item() < 3e-5 and error[2].item() < 3e-4


def test_int16_rows_are_rounded_as_the_formula_says(isa: str) -> None:
    torch.manual_seed(9)
    x = torch.randn(5, 300) * torch.tensor([1.0, 1e-3, 1e3, 0.0, 1.0])[:, None]
    x[4, :4] = torch.tensor([32767.5, -0.5, 1.5, 2.5]) / 32767.5 * 3  # ties: half to even
    assert torch.equal(cpu_kernels.round_rows_int16(x), _int16_rows(x).float())  # q * S rounded once to float32
    assert not bool(cpu_kernels.round_rows_int16(x)[3].any())


def test_int16_activation_sums_do_not_overflow_at_the_extremes(isa: str) -> None:
    """K = 8192 (the int16 path's limit), every weight 127 or -127, every activation at the row's
    largest magnitude: each int32 lane reaches 2 x 127 x 32767 x 256 < 2^31 and must stay exact."""
    k = 8192
    q = torch.full((4, k), 127, dtype=torch.int8)
    q[1] = -127
    scale = torch.full((4,), 0.01)
    x = torch.full((2, k), 3.0)
    x[1] *= -1
    ref = _int8_input(x) @ (q.double() * scale.double()[:, None]).T
    got = cpu_kernels.gemv_int8(x, q, scale, torch.float32).double()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("n, k", [(301, 640), (77, 200), (64, 37), (1029, 2048)])
def test_one_row_products_give_the_same_bits_in_either_row_order(n: int, k: int, isa: str) -> None:
    """A decode row walks the weights row after row ("stream", AMD) or in interleaved row groups
    ("interleave", Intel): both are float32 accumulation of the exact products (float64
    reference) and agree bit for bit, for bf16, float32 and int8 weights, N past the group size."""
    torch.manual_seed(n + k)
    w = torch.randn(n, k).bfloat16()
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n) * 0.01 + 1e-3
    x = torch.randn(1, k).bfloat16()
    wq = q.double() * scale.double()[:, None]
    got: dict[str, list[torch.Tensor]] = {}
    for order in ("stream", "interleave"):
        with cpu_kernels.use_row_order(order):
            assert cpu_kernels.row_order() == order
            got[order] = [
                cpu_kernels.gemv_bf16(x, w, torch.float32),
                cpu_kernels.gemv_bf16(x.float(), w, torch.float32),
                cpu_kernels.gemv_f32(x.float(), w.float(), torch.float32),
                cpu_kernels.gemv_int8(x.float(), q, scale, torch.float32),
            ]
    xq = _int8_input(x.float())
    refs = [x.double() @ w.double().T] * 3 + [xq @ wq.T]
    bounds = [k * 2.0**-23 * (x.double().abs() @ w.double().abs().T)] * 3
    bounds.append(2 * k * 2.0**-23 * (xq.abs() @ wq.abs().T))
    for stream, interleave, ref, bound in zip(got["stream"], got["interleave"], refs, bounds):
        assert torch.equal(stream, interleave)
        assert bool(((stream.double() - ref).abs() <= bound + 1e-30).all())
    with pytest.raises(RuntimeError, match="row order must be"):
        cpu_kernels.load().set_row_order("diagonal")


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path: Path) -> None:
    import time

    from serve.cpu_kernels import clear_stale_lock

    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_stale_lock(tmp_path, max_age=600) and lock.exists()  # a build may hold it
    old = time.time() - 3600
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path, max_age=600) and not lock.exists()
    assert not clear_stale_lock(tmp_path, max_age=600)  # nothing to remove


def _owner_record(pid: int) -> str:
    import socket

    return f"{socket.gethostname()} {pid}\n"


def test_a_lock_whose_owner_died_is_taken_over_at_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A build killed midway left torch's lock and its owner record (a pid that no longer runs):
    the next build takes over without waiting, records itself, and clears its record after."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "lock").touch()  # fresh: the age rule alone would wait 600 s
    (tmp_path / cpu_kernels.OWNER_FILE).write_text(_owner_record(dead.pid))
    with caplog.at_level("WARNING", logger="serve.cpu_kernels"):
        with cpu_kernels.build_lock(tmp_path, max_age=600, poll=0.01):
            assert not (tmp_path / "lock").exists()
            assert (tmp_path / cpu_kernels.OWNER_FILE).read_text() == _owner_record(os.getpid())
    assert not (tmp_path / cpu_kernels.OWNER_FILE).exists()
    assert f"pid {dead.pid}" in caplog.text and "is gone" in caplog.text


def _build_in_thread(build_dir: Path) -> tuple[threading.Thread, threading.Event]:
    """A started thread that takes the build lock (polling every 10 ms); the event is set once it holds it."""
    entered = threading.Event()

    def build() -> None:
        with cpu_kernels.build_lock(build_dir, max_age=600, poll=0.01):
            entered.set()

    waiter = threading.Thread(target=build)
    waiter.start()
    return waiter, entered


def test_a_live_builder_is_waited_for_with_one_message(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """While the owner runs, the next process waits and says so once; when it dies, it takes over."""
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (tmp_path / cpu_kernels.OWNER_FILE).write_text(_owner_record(owner.pid))
    with caplog.at_level("WARNING", logger="serve.cpu_kernels"):
        waiter, entered = _build_in_thread(tmp_path)
        try:
            assert not entered.wait(0.5)  # held by a live process: still waiting
        finally:
            owner.kill()
            owner.wait()
        waiter.join(10)
    assert entered.is_set() and not waiter.is_alive()
    waits = [r for r in caplog.records if r.getMessage().startswith("waiting for")]
    assert len(waits) == 1 and f"pid {owner.pid}" in waits[0].getMessage()


def test_an_unowned_fresh_lock_is_waited_for_and_an_old_one_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import time

    lock = tmp_path / "lock"
    lock.touch()
    with caplog.at_level("WARNING", logger="serve.cpu_kernels"):
        waiter, entered = _build_in_thread(tmp_path)
        assert not entered.wait(0.3)
        old = time.time() - 3600
        os.utime(lock, (old, old))  # now older than max_age: a killed build's
        waiter.join(10)
    assert entered.is_set() and not lock.exists()
    assert sum(r.getMessage().startswith("waiting for a build lock") for r in caplog.records) == 1


@pytest.mark.parametrize("rows, vocab", [(1, 7), (1, 278_144), (3, 4097), (40, 20_000), (0, 16)])
def test_argmax_rows_equals_torch_argmax(rows: int, vocab: int) -> None:
    """Random rows, also fewer rows than threads (a row is then split into segments)."""
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows + vocab))
    assert torch.equal(cpu_kernels.argmax_rows(x), x.argmax(-1))


def test_argmax_rows_keeps_torchs_ties_nans_and_infinities() -> None:
    """First maximum on ties (also across segments), first NaN when a row has one, 0 for all -inf."""
    x = torch.randn(6, 100_000, generator=torch.Generator().manual_seed(0))
    x[0, [10, 99_990]] = 50.0  # a tie far apart: the first wins
    x[1, [500, 90_000]] = float("nan")  # NaN beats everything, the first one
    x[1, 7] = float("inf")
    x[2] = float("-inf")
    x[3, 99_999] = float("inf")  # +inf in the last element
    x[4, :] = 1.0  # all equal
    x[5, 64_000] = float("nan")  # a NaN only in a later segment
    assert torch.equal(cpu_kernels.argmax_rows(x), x.argmax(-1))
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            assert torch.equal(cpu_kernels.argmax_rows(x[:1]), x[:1].argmax(-1))
            assert torch.equal(cpu_kernels.argmax_rows(x[5:]), x[5:].argmax(-1))
        finally:
            torch.set_num_threads(before)


def test_argmax_rows_refuses_what_it_does_not_take() -> None:
    with pytest.raises(RuntimeError, match="float32 CPU logits"):
        cpu_kernels.argmax_rows(torch.randn(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32 CPU logits"):
        cpu_kernels.argmax_rows(torch.randn(8))


@pytest.mark.parametrize(
    "shape, weight_rows", [((9, 640), 1), ((300, 96), 1), ((7, 5, 256), 5), ((0, 64), 1), ((5, 100), 1), ((3, 13), 1)]
)
def test_rms_norm_bf16_scaled_matches_the_torch_formula(shape: tuple[int, ...], weight_rows: int) -> None:
    """Gemma's norm as serve writes it in torch, (rms_norm(x.float()) * (1 + w)).to(bf16), with one
    weight row per head where the weight has several (q/k norms): at most one bf16 step away and
    nearly always equal (only the order of the float32 sum of squares differs)."""
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=gen) * 4).bfloat16()
    w = 1.0 + torch.randn(weight_rows, shape[-1], generator=gen).squeeze(0) * 0.3
    ref = (torch.nn.functional.rms_norm(x.float(), (shape[-1],), eps=1e-6) * w).to(torch.bfloat16)
    got = cpu_kernels.rms_norm_bf16_scaled(x, w, 1e-6)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    if ref.numel():
        ulps = (got.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
        assert int(ulps.max()) <= 1
        assert (got == ref).float().mean().item() > 0.999
    with pytest.raises(RuntimeError, match="float32 weight"):
        cpu_kernels.rms_norm_bf16_scaled(x, w.bfloat16(), 1e-6)


def test_each_checkout_builds_its_own_library(tmp_path: Path) -> None:
    """Two copies of the same sources get different library names (torch's build.ninja names the
    source paths, so sharing one name made them rebuild each other's objects); one copy keeps its
    name, and any change to a source gives a new one."""
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(cpu_kernels.CSRC, a)
    shutil.copytree(cpu_kernels.CSRC, b)
    assert cpu_kernels.extension_name(a) != cpu_kernels.extension_name(b)
    assert cpu_kernels.extension_name(a) == cpu_kernels.extension_name(a)
    before = cpu_kernels.extension_name(a)
    (a / "norm.cpp").write_text((a / "norm.cpp").read_text() + "\n// changed\n")
    assert cpu_kernels.extension_name(a) != before
