"""serve's AMX tile GEMM (csrc/amx.cpp) against independent references, and its dispatch.

References: a brute-force loop for the tile order of `amx_pack`; float64 matmuls on the same
bf16 values for the products (float32 accumulation: within k * 2^-23 * |x||w| of the exact sum;
rounded once to bf16: within one bf16 spacing more). The engine-level pieces (`DenseLinear`,
`SlicedHead`) are checked against the same references with AMX on, and to build no oneDNN copy.
The kernel tests need a CPU and OS that give AMX tiles (Sapphire Rapids and later); the
dispatch tests (a CPU or OS without AMX falls back to avx512_bf16) run everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from serve import cpu_kernels
from serve.head import SlicedHead
from serve.quant import DenseLinear
from tests.serve.test_cpu_attention import make_case, run_kernel


def _amx_here() -> bool:
    if not set(cpu_kernels.ISA_FLAGS["amx"]) <= cpu_kernels.cpu_flags():
        return False
    lib = cpu_kernels.load()
    return lib is not None and bool(lib.amx_enable())


needs_amx = pytest.mark.skipif(not _amx_here(), reason="this CPU or OS gives no AMX tiles (amx_tile, amx_bf16)")


@pytest.fixture
def amx() -> Iterator[None]:
    """The amx variant for the test (the loaded one is restored after)."""
    with cpu_kernels.use_isa("amx"):
        yield


def _spacing(ref: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(ref.abs().clamp(min=1e-30))) - 7)


def _brute_tile_order(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K/32, 16, 32]: tile row p holds features 2p, 2p+1 of each of 16 outputs, by loops."""
    n, k = w.shape
    out = torch.empty(n // 16, k // 32, 16, 32, dtype=w.dtype)
    for nb in range(n // 16):
        for kb in range(k // 32):
            for p in range(16):
                for o in range(16):
                    for j in range(2):
                        out[nb, kb, p, 2 * o + j] = w[16 * nb + o, 32 * kb + 2 * p + j]
    return out


def _bounds(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact result (float64) and the float32 accumulation bound of x @ w.T (+ bias)."""
    ref = x.double() @ w.double().T
    if bias is not None:
        ref = ref + bias.double()
    return ref, x.shape[1] * 2.0**-23 * (x.double().abs() @ w.double().abs().T) + 1e-30


@needs_amx
@pytest.mark.parametrize("n, k", [(16, 32), (48, 64), (32, 96)])
def test_pack_is_the_tile_order(n: int, k: int, amx: None) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)).bfloat16()
    assert torch.equal(cpu_kernels.amx_pack(w), _brute_tile_order(w))


@needs_amx
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 33, 100])
@pytest.mark.parametrize("n, k", [(16, 32), (48, 640), (272, 96), (64, 2048)])
def test_bf16_out_is_float32_accumulation_rounded_once(rows: int, n: int, k: int, amx: None) -> None:
    """Row counts off and on the 16-row tiles, an odd number of 16-output blocks, a bias."""
    g = torch.Generator().manual_seed(rows * 7 + n + k)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(rows, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    ref, acc = _bounds(x, w, bias)
    got = cpu_kernels.amx_linear(x, cpu_kernels.amx_pack(w), bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert bool(((got.double() - ref).abs() <= _spacing(ref) + acc).all())


@needs_amx
def test_float32_out_is_written_in_place_rounded_through_bf16(amx: None) -> None:
    """The LM head's use: a float32 view with a row stride wider than its columns, left intact around it."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(96, 640, generator=g).bfloat16(), torch.randn(21, 640, generator=g).bfloat16()
    buf = torch.full((21, 130), float("nan"))
    out = buf[:, 17:113]
    got = cpu_kernels.amx_linear(x, cpu_kernels.amx_pack(w), out=out)
    assert got is out
    ref, acc = _bounds(x, w)
    assert bool(((out.double() - ref).abs() <= _spacing(ref) + acc).all())
    assert torch.equal(out, out.bfloat16().float())  # bf16 values, widened
    assert bool(buf[:, :17].isnan().all()) and bool(buf[:, 113:].isnan().all())


@needs_amx
def test_large_float32_out_streams_the_same_numbers_aligned_or_not(amx: None) -> None:
    """Past 4 MiB a float32 output goes around the caches (non-temporal stores) when its rows start
    on 64-byte lines; a view off the lines takes plain stores. Both hold the same, right, numbers."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(65536, 64, generator=g).bfloat16(), torch.randn(20, 64, generator=g).bfloat16()
    packed = cpu_kernels.amx_pack(w)
    aligned = torch.full((20, 65536), float("nan"))
    assert aligned.data_ptr() % 64 == 0 and aligned.numel() * 4 >= 4 << 20
    buf = torch.full((20, 65536 + 21), float("nan"))
    off = buf[:, 3 : 3 + 65536]  # row starts 12 bytes past a line, row stride not a multiple of 16
    cpu_kernels.amx_linear(x, packed, out=aligned)
    cpu_kernels.amx_linear(x, packed, out=off)
    ref, acc = _bounds(x, w)
    assert bool(((aligned.double() - ref).abs() <= _spacing(ref) + acc).all())
    assert torch.equal(aligned, off)
    assert bool(buf[:, :3].isnan().all()) and bool(buf[:, 3 + 65536 :].isnan().all())


@needs_amx
def test_results_do_not_depend_on_thread_count(amx: None) -> None:
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(160, 256, generator=g).bfloat16(), torch.randn(37, 256, generator=g).bfloat16()
    packed = cpu_kernels.amx_pack(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.amx_linear(x, packed)
        torch.set_num_threads(max(2, before))
        many = cpu_kernels.amx_linear(x, packed)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


@needs_amx
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_amx_attends_with_the_avx512_bf16_kernel(dtype: torch.dtype, amx: None) -> None:
    """The amx variant runs the avx512_bf16 attention, bit for bit, not the AVX2 fallback (the AVX2
    kernel sums in another order: once amx was sent there and a mixed step attended 1.5x slower)."""
    q, kc, vc, chunks = make_case(3, 4, 1, 256, 16, dtype)
    got = run_kernel(q, kc, vc, chunks, 16, 0.0625)
    runs = {}
    for name in ("avx512_bf16", "avx2"):
        with cpu_kernels.use_isa(name):
            runs[name] = run_kernel(q, kc, vc, chunks, 16, 0.0625)
    assert torch.equal(got, runs["avx512_bf16"])
    assert not torch.equal(runs["avx2"], runs["avx512_bf16"])  # the comparison can tell the kernels apart


@needs_amx
def test_bad_shapes_are_named_errors(amx: None) -> None:
    with pytest.raises(RuntimeError, match=r"outputs \(40\) must be a multiple of 16 and inputs \(64\) of 32"):
        cpu_kernels.amx_pack(torch.zeros(40, 64, dtype=torch.bfloat16))
    packed = cpu_kernels.amx_pack(torch.zeros(32, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x has 96 features, the weight 64"):
        cpu_kernels.amx_linear(torch.zeros(2, 96, dtype=torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match="bf16 rows"):
        cpu_kernels.amx_linear(torch.zeros(2, 64), packed)
    with pytest.raises(RuntimeError, match=r"out must be \[2, 32\]"):
        cpu_kernels.amx_linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed, out=torch.zeros(2, 16))


@needs_amx
@pytest.mark.parametrize("rows", [3, 5, 40, 300])
def test_dense_linear_runs_batches_on_amx_with_one_copy(rows: int, amx: None) -> None:
    """Past the one-row kernel (4 rows) batches take the tiles; no oneDNN copy is kept beside them."""
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(128, 640, generator=g).bfloat16(), torch.randn(rows, 640, generator=g).bfloat16()
    lin = DenseLinear(w)
    assert lin.amx is not None and lin.packed is None
    ref, acc = _bounds(x, w)
    got = lin(x)
    assert bool(((got.double() - ref).abs() <= _spacing(ref) + acc).all())
    assert torch.equal(lin(x.reshape(1, rows, 640)), got.reshape(1, rows, 128))  # prefill's 3-D rows


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_sliced_head_on_amx_writes_the_logits_in_place(rows: int, amx: None) -> None:
    g = torch.Generator().manual_seed(rows + 11)
    w, x = (torch.randn(1024, 64, generator=g) * 0.05).bfloat16(), torch.randn(rows, 64, generator=g).bfloat16()
    head = SlicedHead(w, slice_rows=300)
    assert head.amx is not None and head.slices == []
    ref, acc = _bounds(x, w)
    out = torch.full((rows, 1024), float("nan"))
    assert head(x, out) is out
    assert bool(((out.double() - ref).abs() <= _spacing(ref) + acc).all())


def test_an_os_that_refuses_the_tiles_runs_avx512_bf16(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the CPU has AMX but the OS grants no tile state (Linux before 5.16), load says so and
    runs the avx512_bf16 kernels instead of failing."""
    chosen: list[str] = []
    fake = SimpleNamespace(amx_enable=lambda: False, set_isa=chosen.append)
    monkeypatch.setattr(cpu_kernels, "select_isa", lambda: "amx")
    monkeypatch.setattr(cpu_kernels, "_cpu_has_avx2", lambda: True)
    monkeypatch.setattr(cpu_kernels, "_build", lambda: fake)
    with caplog.at_level(logging.WARNING, logger="serve.cpu_kernels"):
        assert cpu_kernels.load.__wrapped__() is fake
    assert chosen == ["avx512_bf16"]
    assert "refused the AMX tile state" in caplog.text


def test_weights_amx_does_not_take_stay_on_the_other_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shapes off the tile grid, float32 weights, or no amx variant: no tile copy is made."""
    monkeypatch.setattr(cpu_kernels, "has_amx", lambda: True)
    assert cpu_kernels.amx_fits(torch.zeros(32, 64, dtype=torch.bfloat16))
    assert not cpu_kernels.amx_fits(torch.zeros(40, 64, dtype=torch.bfloat16))
    assert not cpu_kernels.amx_fits(torch.zeros(32, 48, dtype=torch.bfloat16))
    assert not cpu_kernels.amx_fits(torch.zeros(32, 64))
    monkeypatch.setattr(cpu_kernels, "has_amx", lambda: False)
    assert not cpu_kernels.amx_fits(torch.zeros(32, 64, dtype=torch.bfloat16))
