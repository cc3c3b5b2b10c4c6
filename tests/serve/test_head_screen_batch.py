"""The batch head screen (`serve.head_screen_batch`): many rows' argmax through uint8 x int8 products.

References: float64 products of the same int8 weights and rounded activations (the kernel's sums
are exact integers), float64 products on the bf16 head (the bound), a brute-force loop (the
candidates), `gemv_bf16` (the exact values, bit for bit), the whole head through its decode
kernel (the argmax, ties and near-ties included) and the engine without the screen (greedy
tokens). Every kernel variant the CPU runs: the batch screen where it applies (avx512_bf16, amx
with AMX-INT8; float32 heads on every VNNI variant), its absence everywhere else.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serve import LLM, SamplingParams, cpu_kernels, head_screen_batch
from serve.head_screen import BF16_STEP, HeadScreen
from serve.sampler import GumbelDraw
from tests.serve.conftest import make_model
from tests.serve.test_head_screen import _head, _rows

pytestmark = [
    pytest.mark.skipif(not cpu_kernels.available(), reason="serve's CPU kernels did not build here"),
    pytest.mark.usefixtures("isa"),
]


def _runs(dtype: torch.dtype, isa: str) -> bool:
    """Where the batch screen should run: bf16 heads on avx512_bf16 and on amx with AMX-INT8 (its
    sums on tiles), float32 on every VNNI variant."""
    if dtype == torch.bfloat16:
        return isa == "avx512_bf16" or (isa == "amx" and "amx_int8" in cpu_kernels.cpu_flags())
    return isa in ("avx512_vnni", "avx512_bf16", "amx")


def _screen(w: torch.Tensor, isa: str) -> HeadScreen:
    """A screen of `w` with its batch layout calibrated; skips where the batch screen does not run,
    after checking that it is absent there."""
    screen = HeadScreen(w)
    if not _runs(w.dtype, isa):
        assert screen.batch is None  # other variants keep the whole head for batches
        pytest.skip(f"no batch screen for a {w.dtype} head on {isa}")
    assert screen.batch is not None
    g = torch.Generator().manual_seed(11)
    screen.batch.observe(torch.randn(head_screen_batch.CALIBRATION_ROWS, w.shape[1], generator=g).to(w.dtype))
    assert screen.batch.ready
    return screen


def _quantized(screen: HeadScreen, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b = screen.batch
    assert b is not None and b.perm is not None
    return cpu_kernels.screen_quantize(x.float().index_select(1, b.perm), b.main, b.tail)


def test_quantized_rows_move_each_value_by_at_most_half_a_step(isa: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 198, generator=g)
    x[:, :5] *= 30  # outliers in the main channels too
    x[3] = x[3].abs()  # a one-sided row: the zero point at 0
    x[4] = 0.0  # an empty row
    tail, main = 24, 176  # 174 main channels padded to 176
    u, w16, params = cpu_kernels.screen_quantize(x, main, tail)
    t, t2, z = (params[:, i].double()[:, None] for i in range(3))
    back_main = t * (u.double()[:, :174] - z)
    back_tail = t2 * w16.double()
    assert ((back_main - x[:, :174].double()).abs() <= t * 0.5 * (1 + 1e-6)).all()
    assert ((back_tail - x[:, 174:].double()).abs() <= t2 * 0.5 * (1 + 1e-6)).all()
    assert torch.equal(u[:, 174:].double(), z.expand(-1, 2))  # padding reads as zero
    assert float(params[4].abs().sum()) == 0.0 and int(u[4].sum()) == 0
    assert float(z[3]) == 0.0


def test_packing_matches_torch_gathers_and_transposes(isa: str) -> None:
    """`screen_pack`'s one pass against the same layouts built with torch ops (index_select, a
    zero-padded copy, a sum and a transposing copy): 1003 rows, the tail channels scattered."""
    screen = _screen(_head(1003, 198, torch.bfloat16, seed=5), isa)
    b = screen.batch
    assert b is not None and b.perm is not None
    vp, k_main, lanes = b.packed[2].numel(), 198 - b.tail, head_screen_batch.LANES
    q = screen.q.index_select(1, b.perm)
    main = torch.zeros(vp, b.main, dtype=torch.int8)
    main[:1003, :k_main] = q[:, :k_main]
    want_main = main.view(vp // lanes, lanes, b.main // 4, 4).transpose(1, 2).reshape(vp // lanes, -1)
    wide = torch.zeros(vp, b.tail, dtype=torch.int16)
    wide[:1003] = q[:, k_main:]
    want_wide = wide.view(vp // lanes, lanes, b.tail // 2, 2).transpose(1, 2).reshape(vp // lanes, -1)
    assert not torch.equal(b.perm, torch.arange(198))  # the tail really moved channels
    assert torch.equal(b.packed[0], want_main)
    assert torch.equal(b.packed[1], want_wide)
    assert torch.equal(b.packed[2], main.sum(dim=1, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 30])
def test_int8_logits_are_float64_products_of_the_rounded_rows(isa: str, rows: int, dtype: torch.dtype) -> None:
    w = _head(1003, 198, dtype, seed=rows)  # 1003 rows: the last tile part padding
    screen = _screen(w, isa)
    b = screen.batch
    assert b is not None and b.perm is not None
    x = _rows(rows, 198, dtype, rows, w)
    u, w16, params = quantized = _quantized(screen, x)
    a, c = torch.rand(rows), torch.rand(rows)
    out = torch.empty(rows, 1003)
    lohi, tile_hi, _ = cpu_kernels.screen_gemm_u8(quantized, b.packed, b.scales, a, c, out)
    q = screen.q.index_select(1, b.perm).double()
    k_main = 198 - b.tail
    t, t2, z = (params[:, i].double()[:, None] for i in range(3))
    main = (u.double()[:, :k_main] - z) @ q[:, :k_main].T
    want = screen.scale.double() * (t * main + t2 * (w16.double() @ q[:, k_main:].T))
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    bound = a.double()[:, None] * screen.scale.double() + c.double()[:, None] * screen.scale_l1.double()
    best = torch.stack([(out.double() - bound).amax(1), (out.double() + bound).amax(1)], dim=1)
    assert torch.allclose(lohi.double(), best, rtol=1e-5, atol=1e-6)
    up = torch.nn.functional.pad(out.double() + bound, (0, 1024 - 1003), value=float("-inf"))
    assert torch.allclose(tile_hi.double(), up.view(rows, 32, 32).amax(2), rtol=1e-5, atol=1e-6)  # per 32 columns


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_logits_stay_within_the_bound_of_float64_products(isa: str, dtype: torch.dtype) -> None:
    w = _head(2000, 200, dtype, seed=7)
    screen = _screen(w, isa)
    b = screen.batch
    assert b is not None
    x = _rows(20, 200, dtype, 3, w)
    quantized = _quantized(screen, x)
    params = quantized[2]
    a, c = screen.bounds(x, torch.maximum(params[:, 0], params[:, 1]) * 0.5)
    out = torch.empty(20, 2000)
    cpu_kernels.screen_gemm_u8(quantized, b.packed, b.scales, a, c, out)
    true = x.double() @ w.double().T
    bound = a.double()[:, None] * screen.scale.double() + c.double()[:, None] * screen.scale_l1.double()
    assert ((out.double() - true).abs() <= bound).all()
    assert (bound < true.abs().amax(dim=1, keepdim=True)).all()  # a bound that screens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 13, 16, 17, 33, 45, 70])
def test_amx_main_sums_give_the_vnni_kernels_logits_and_bounds_bit_for_bit(
    isa: str, rows: int, dtype: torch.dtype
) -> None:
    """On AMX-INT8 (TDPBUSD) the main sums are the same exact integers: every output equal. Row
    counts cover one and two 16-row blocks, partial blocks and a third block."""
    if not cpu_kernels.screen_on_amx():
        pytest.skip(f"{isa}: the screen's main sums stay on AVX-512 VNNI (amx variant with AMX-INT8 only)")
    w = _head(1003, 640, dtype, seed=rows)
    screen = _screen(w, isa)
    b = screen.batch
    assert b is not None and b.main % cpu_kernels.SCREEN_AMX_K == 0  # 608 main channels padded to 640
    x = _rows(rows, 640, dtype, rows, w)
    quantized = _quantized(screen, x)
    a, c = torch.rand(rows), torch.rand(rows)
    got = [torch.full((rows, 1003), float("nan")) for _ in range(2)]
    amx = cpu_kernels.screen_gemm_u8(quantized, b.packed, b.scales, a, c, got[0], amx=True)
    vnni = cpu_kernels.screen_gemm_u8(quantized, b.packed, b.scales, a, c, got[1], amx=False)
    assert torch.equal(got[0], got[1])
    assert all(torch.equal(p, q) for p, q in zip(amx[:2], vnni[:2]))  # best bounds and tile maxima


@pytest.mark.parametrize("widen", [False, True])
@pytest.mark.parametrize("rows", [5, 33])
def test_sparse_stores_give_screen_pairs_the_dense_candidates(isa: str, rows: int, widen: bool) -> None:
    """With `floor`, blocks below a row's floor are not stored: `screen_pairs`, told which were,
    must find the same candidates and values as after dense stores, every kernel path (AMX where
    it runs). `widen`: the last column's bound made huge, so its row's final floor falls far below
    what the thread that never saw it skipped blocks under; those are computed again."""
    w = _head(6000, 640, torch.bfloat16, seed=rows)
    screen = _screen(w, isa)
    b = screen.batch
    assert b is not None
    x = _rows(rows, 640, torch.bfloat16, rows, w)
    quantized = _quantized(screen, x)
    a, c = screen.bounds(x, torch.maximum(quantized[2][:, 0], quantized[2][:, 1]) * 0.5)
    scales = (b.scales[0], b.scales[1].clone())
    if widen:
        scales[1][5999] *= 1e6
    paths = [False, True] if cpu_kernels.screen_on_amx() else [False]
    for amx in paths:
        dense, sparse = torch.full((rows, 6000), float("nan")), torch.full((rows, 6000), float("nan"))
        want = cpu_kernels.screen_gemm_u8(quantized, b.packed, scales, a, c, dense, amx=amx)
        got = cpu_kernels.screen_gemm_u8(quantized, b.packed, scales, a, c, sparse, amx=amx, floor=(BF16_STEP, 1e-6))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # best bounds, tile maxima
        written = got[2]
        assert written is not None and want[2] is None and written.shape == (rows, 2 * got[1].shape[1])
        left = written.repeat_interleave(16, dim=1)[:, :6000] == 0
        assert torch.equal(left, sparse.isnan())  # the blocks it says it left are the ones left
        assert bool((written == 2).any()) == widen  # refilled only where the floor fell
        assert widen or bool(left.any())
        pairs = [
            cpu_kernels.screen_pairs(o, scales, a, c, got[0], got[1], BF16_STEP, 1e-6, 6000, k)
            for o, k in ((dense, None), (sparse, written))
        ]
        assert all(torch.equal(p, q) for p, q in zip(*pairs))
        r, cols, _ = pairs[1]
        assert torch.equal(sparse[r, cols], dense[r, cols])


def test_pairs_match_a_brute_force_selection(isa: str) -> None:
    if isa != "avx512_bf16":
        pytest.skip("the batch screen runs on avx512_bf16 only")
    g = torch.Generator().manual_seed(0)
    approx = torch.randn(4, 1003, generator=g) * 4
    approx[3] = 0.0  # a flat row: every column reaches its floor
    scale, scale_l1 = torch.rand(1003, generator=g), torch.rand(1003, generator=g)
    a, c = torch.rand(4, generator=g), torch.rand(4, generator=g)
    bound = a[:, None] * scale + c[:, None] * scale_l1
    lohi = torch.stack([(approx - bound).amax(1), (approx + bound).amax(1)], dim=1)
    up = torch.nn.functional.pad(approx + bound, (0, 1024 - 1003), value=float("-inf"))
    tile_hi = up.view(4, 32, 32).amax(2).contiguous() + 1e-3  # at or above every column of its tile
    rows, cols, counts = cpu_kernels.screen_pairs(approx, (scale, scale_l1), a, c, lohi, tile_hi, 2.0**-7, 0.25, 300)
    low, high = lohi[:, 0], lohi[:, 1]
    floor = low - torch.maximum(low.abs(), high.abs()) * 2.0**-7 - 0.25
    want = [[v for v in range(1003) if float(approx[m, v] + bound[m, v]) >= float(floor[m])] for m in range(4)]
    assert counts.tolist() == [len(want[0]), len(want[1]), len(want[2]), -1]
    got = [cols[rows == m].tolist() for m in range(3)]
    assert got == want[:3] and not (rows == 3).any()
    # a tile whose maximum stays below the floor is not read: its columns drop out even where they reach it
    hit = want[0][0] // 32
    tile_hi[0, hit] = float("-inf")
    rows, cols, _ = cpu_kernels.screen_pairs(approx, (scale, scale_l1), a, c, lohi, tile_hi, 2.0**-7, 0.25, 300)
    assert cols[rows == 0].tolist() == [v for v in want[0] if v // 32 != hit]
    tile_hi[0, hit] = float("nan")  # a NaN maximum compares false: its tile is read
    rows, cols, _ = cpu_kernels.screen_pairs(approx, (scale, scale_l1), a, c, lohi, tile_hi, 2.0**-7, 0.25, 300)
    assert cols[rows == 0].tolist() == want[0]


def test_float32_pair_products_against_float64(isa: str) -> None:
    if not _runs(torch.float32, isa):
        pytest.skip(f"no batch screen for a float32 head on {isa}")
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 203, generator=g), torch.randn(300, 203, generator=g)  # a 203-wide tail
    rows = torch.randint(0, 5, (400,), generator=g)
    cols = torch.randint(0, 300, (400,), generator=g)
    got = cpu_kernels.gemv_f32_pairs(x, w, rows, cols).double()
    want = (x.double()[rows] * w.double()[cols]).sum(1)
    scale = (x.double()[rows].abs() * w.double()[cols].abs()).sum(1)
    assert ((got - want).abs() <= scale * 203 * 2.0**-24).all()
    again = cpu_kernels.gemv_f32_pairs(x, w, rows.flip(0), cols.flip(0)).double()
    assert torch.equal(again.flip(0), got)  # a pair's value does not depend on the others


def test_pair_products_are_gemv_bf16s_bit_for_bit(isa: str) -> None:
    if isa != "avx512_bf16":
        pytest.skip("gemv_bf16_pairs runs on the avx512_bf16 and amx variants")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 200, generator=g).to(torch.bfloat16)
    w = torch.randn(300, 200, generator=g).to(torch.bfloat16)
    rows = torch.randint(0, 5, (400,), generator=g)
    cols = torch.randint(0, 300, (400,), generator=g)
    want = cpu_kernels.gemv_bf16(x, w, torch.bfloat16).float()[rows, cols]
    assert torch.equal(cpu_kernels.gemv_bf16_pairs(x, w, rows, cols), want)


def _whole(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The whole head: the decode kernel's bf16 logits (bit for bit what the screen's candidates
    get), float64 products for a float32 head (the screen's float32 sums agree to rounding)."""
    return HeadScreen.exact(x, w) if w.dtype == torch.bfloat16 else (x.double() @ w.double().T).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [9, 16, 40])
def test_batch_argmax_is_the_whole_heads_and_candidates_are_exact(isa: str, rows: int, dtype: torch.dtype) -> None:
    w = _head(3000, 96, dtype, seed=rows)
    screen = _screen(w, isa)
    assert screen.batch is not None
    for seed in range(4):
        x = _rows(rows, 96, dtype, seed, w)
        whole = _whole(x, w)
        best = whole.argmax(-1)
        got = screen.screened(x, None, small_rows=8)
        assert got is not None and got.dtype == torch.long and got.shape == (rows,)
        if dtype == torch.bfloat16:
            assert torch.equal(got, best)
        else:  # float32 sums against float64: the chosen row is the best up to their rounding
            chosen = whole.gather(1, got[:, None])[:, 0]
            assert ((whole.gather(1, best[:, None])[:, 0] - chosen) <= 1e-5 * whole.abs().amax(1)).all()
        found = screen.batch.candidates(x, screen.bounds, BF16_STEP, 1e-6, torch.full((rows, 3000), float("nan")))
        assert found is not None
        r, cols, exact = found
        want = whole[r, cols]
        assert (
            torch.equal(exact, want) if dtype == torch.bfloat16 else torch.allclose(exact, want, rtol=1e-5, atol=1e-5)
        )
        assert all(int(best[m]) in cols[r == m].tolist() for m in range(rows))  # the winner is a candidate
        assert all(bool((cols[r == m].diff() > 0).all()) for m in range(rows))  # ascending within a row
        assert cols.numel() < rows * 3000  # it screened something out
    x = _rows(rows, 96, dtype, 0, w)
    assert int(screen.screened(x, None, small_rows=8)[0]) == 10  # type: ignore[index]  # first of the ties
    assert screen.batch.calls == 5 * rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_whole_head_until_calibrated_and_for_flat_or_sampled_rows(isa: str, dtype: torch.dtype) -> None:
    w = _head(3000, 96, dtype, seed=3)
    screen = HeadScreen(w)
    x = _rows(12, 96, dtype, 1, w)
    if screen.batch is None:
        assert not _runs(dtype, isa)
        assert screen.screened(x, None, small_rows=8) is None
        return
    seen = 0
    while not screen.batch.ready:  # each batch the head reads counts toward the calibration
        got = screen.screened(x, None, small_rows=8)
        seen += 12
        assert (got is None) != screen.batch.ready  # the batch that completes it is screened
    assert seen >= head_screen_batch.CALIBRATION_ROWS and screen.batch.seen == seen
    assert screen.screened(x, None, small_rows=8) is not None
    draw = GumbelDraw(torch.ones(12), torch.zeros(12, 3000))
    assert screen.screened(x, draw, small_rows=8) is None  # sampled rows: the whole head
    flat = screen.flat
    assert screen.screened(torch.zeros(12, 96, dtype=dtype), None, small_rows=8) is None
    assert screen.flat == flat + 12
    nan = x.clone()
    nan[2, 5] = float("nan")
    assert screen.screened(nan, None, small_rows=8) is None


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with a 17k-row head: large enough for the engine to screen it."""
    return make_model(tmp_path_factory.mktemp("screen_batch"), seed=6, vocab_size=17000)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_served_batch_greedy_tokens_equal_the_whole_heads(
    big_vocab: Path, isa: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twelve requests decode together (12 logits rows a step): the same tokens with and without
    the screen, and past the calibration the batch screen found them."""
    monkeypatch.setattr(head_screen_batch, "CALIBRATION_ROWS", 24)
    prompts = [[5 + i, 6 + 2 * i, 7, 8 + i] for i in range(12)]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in LLM(big_vocab, dtype=dtype, head_screen=False).generate(prompts, greedy)]
    screened = LLM(big_vocab, dtype=dtype)
    assert [o.token_ids for o in screened.generate(prompts, greedy)] == want
    screen = screened.runner.target.screen
    batch = None if screen is None else screen.batch
    assert (batch is not None) == (screen is not None and _runs(getattr(torch, dtype), isa))
    assert batch is None or batch.calls >= 12 * 5


def test_speculative_verification_of_many_rows_is_batch_screened_and_unchanged(
    big_vocab: Path, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompt lookup drafts 3 tokens for each of 5 requests: 20 greedy verification rows a step."""
    monkeypatch.setattr(head_screen_batch, "CALIBRATION_ROWS", 24)
    prompts = [[5 + i, 6, 7, 8] * 6 for i in range(5)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    spec = {"prompt_lookup_max": 3, "num_speculative_tokens": 3}
    want = [o.token_ids for o in LLM(big_vocab, dtype="bfloat16", head_screen=False, **spec).generate(prompts, greedy)]
    screened = LLM(big_vocab, dtype="bfloat16", **spec)
    assert [o.token_ids for o in screened.generate(prompts, greedy)] == want
    assert screened.stats.lookup_proposed > 0
    screen = screened.runner.target.screen
    batch = None if screen is None else screen.batch
    assert batch is None or batch.calls > 0


def test_head_screen_bench_records_real_rows_and_agrees_with_the_whole_head(big_vocab: Path, isa: str) -> None:
    """`benchmarks.head_screen_bench` on the tiny model: rows recorded while serving calibrate the
    screen, the held-out ones give the whole head's argmax; timings are reported, not asserted."""
    from benchmarks.head_screen_bench import measure, record_rows

    llm = LLM(big_vocab, dtype="float32")
    screen = llm.runner.target.screen
    if screen is None or screen.batch is None:
        assert not _runs(torch.float32, isa)
        pytest.skip(f"no batch screen for a float32 head on {isa}")
    rows = record_rows(llm, 40)
    assert screen.batch.ready and rows.shape[0] - screen.batch.seen >= 12
    (result,) = measure(llm, rows, [12], reps=1)
    assert result["rows"] == 12 and result["same_argmax"] and result["whole_ms"] > 0 and result["screen_ms"] > 0
