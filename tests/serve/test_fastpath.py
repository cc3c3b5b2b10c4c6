"""The CPU speed-ups must not change results: prepacked bf16 linears and the bf16 RMSNorm are
bit-identical to their references (serve's small-batch bf16 GEMM, on AVX-512 BF16 CPUs, within
float32 accumulation error and one bf16 rounding of float64); context-split attention groups
match the slot-by-slot oracle; bf16 linears and attention computed in float32 (CPUs without
native bf16) are within one bf16 rounding of a float64 reference, as a native bf16 kernel is.

References are independent: `F.linear` on the plain weight, transformers' RMSNorm formula
written out (upcast, mean of squares, rsqrt, downcast, weight), `paged_attention_reference`,
float64 matmuls.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from serve import cpu_kernels
from serve.attention import SeqChunk, TorchPagedAttention, paged_attention_reference
from serve.attention.torch_ref import split_by_context
from serve.model import rms_norm
from serve.quant import F32_KERNEL_MAX_ROWS, NATIVE_BF16_KERNEL_MAX_ROWS, PACKED_MAX_ROWS, DenseLinear


@pytest.mark.parametrize("rows", [1, 3, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_linear_bf16_equals_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    w = torch.randn(300, 96).bfloat16()
    b = torch.randn(300).bfloat16() if bias else None
    lin = DenseLinear(w, b, upcast=False)
    x = torch.randn(rows, 96).bfloat16()
    want = F.linear(x, w, b)
    if NATIVE_BF16_KERNEL_MAX_ROWS < rows <= lin.gemm_max_rows:  # serve's GEMM: its own summation order
        ref = F.linear(x.double(), w.double(), b.double() if bias else None)
        step = torch.exp2(torch.floor(torch.log2(ref.abs().clamp(min=1e-30))) - 7)  # one bf16 step
        mag = F.linear(x.double().abs(), w.double().abs(), b.double().abs() if bias else None)
        bound = step + (96 / 16 + 8) * 2.0**-23 * mag  # float32 accumulation (tests/serve/test_gemm_bf16.py)
        for got in (lin(x), lin(x[None])[0]):
            assert bool(((got.double() - ref).abs() <= bound).all())
        return
    assert torch.equal(lin(x), want)
    assert torch.equal(lin(x[None])[0], want)  # 3-d input takes the plain path


@pytest.mark.parametrize(
    "rows", [0, 1, 3, F32_KERNEL_MAX_ROWS, F32_KERNEL_MAX_ROWS + 1, 37, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1]
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kernels", [False, True])
def test_dense_linear_float32_matches_float64(rows: int, bias: bool, kernels: bool) -> None:
    """float32 weights: serve's kernel up to F32_KERNEL_MAX_ROWS rows, oneDNN-prepacked up to
    PACKED_MAX_ROWS rows, MKL above; all are float32 accumulations of the exact product
    (summation order aside), in 2-d and 3-d shapes."""
    if kernels and not cpu_kernels.available():
        pytest.fail("serve's AVX2 kernels did not build on this CPU")
    torch.manual_seed(rows + 7)
    w, x = torch.randn(300, 100), torch.randn(rows, 100)
    b = torch.randn(300) if bias else None
    lin = DenseLinear(w, b, use_kernels=kernels)
    assert lin.packed_f32 is not None or not torch.backends.mkldnn.is_available()
    assert lin.f32_kernel_max_rows == (F32_KERNEL_MAX_ROWS if kernels else 0)
    ref = F.linear(x.double(), w.double(), b.double() if bias else None)
    bound = 100 * 2.0**-23 * (F.linear(x.double().abs(), w.double().abs()) + 1)
    for got in (lin(x), lin(x[None])[0]):
        assert got.dtype == torch.float32 and got.shape == (rows, 300)
        assert bool(((got.double() - ref).abs() <= bound).all())


def _bf16_spacing(ref: torch.Tensor) -> torch.Tensor:
    """Distance between adjacent bf16 values around `ref` (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(ref.abs().clamp(min=1e-30))) - 7)


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 37, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_linear_upcast_is_one_bf16_rounding_of_float64(rows: int, bias: bool, kernels: bool) -> None:
    """Every path of a bf16 weight on a CPU without native bf16 (serve's kernel for small
    batches, the float32 copy otherwise) rounds the float32-accumulated product once."""
    torch.manual_seed(rows + 100)
    w = torch.randn(300, 96).bfloat16()
    b = torch.randn(300).bfloat16() if bias else None
    x = torch.randn(rows, 96).bfloat16()
    if rows == 1 and not kernels:
        return  # without the kernels one row keeps torch's bf16 GEMV: covered by the test below
    got = DenseLinear(w, b, upcast=True, use_kernels=kernels)(x)
    assert got.dtype == torch.bfloat16
    ref = F.linear(x.double(), w.double(), b.double() if bias else None)
    # within one rounding of the exact result (a native bf16 GEMM promises no more), plus float32
    # accumulation error where the sum cancels to nearly zero
    accumulation = 96 * 2.0**-24 * F.linear(x.double().abs(), w.double().abs())
    assert bool(((got.double() - ref).abs() <= _bf16_spacing(ref) + accumulation).all())
    # and for most entries exactly the correctly rounded value
    assert (got == ref.to(torch.bfloat16)).float().mean() > 0.99


def test_dense_linear_upcast_switches_by_rows() -> None:
    w = torch.randn(64, 32).bfloat16()
    lin = DenseLinear(w, upcast=True, use_kernels=False)
    assert lin.upcast_min_rows == 2 and lin.kernel_max_rows == 0
    one, many = torch.randn(1, 32).bfloat16(), torch.randn(PACKED_MAX_ROWS + 1, 32).bfloat16()
    assert torch.equal(lin(one), F.linear(one, w))  # without serve's kernels one row keeps torch's bf16 GEMV
    assert torch.equal(lin(many), F.linear(many.float(), w.float()).bfloat16())  # MKL above the packed range
    assert DenseLinear(w.float(), upcast=True).weight32 is None  # float32 models are untouched
    fast = DenseLinear(w, upcast=True, use_kernels=True)
    few = torch.randn(cpu_kernels.MAX_ROWS, 32).bfloat16()
    assert torch.equal(fast(few), cpu_kernels.gemv_bf16(few, w))  # decode and verification batches
    assert torch.equal(fast(many), lin(many))
    native = DenseLinear(w, upcast=False, use_kernels=True)  # native bf16: vdpbf16ps for decode rows only
    assert native.weight32 is None
    if cpu_kernels.has_bf16_dot():
        assert native.kernel_max_rows == NATIVE_BF16_KERNEL_MAX_ROWS
        four = few[:NATIVE_BF16_KERNEL_MAX_ROWS]
        assert torch.equal(native(four), cpu_kernels.gemv_bf16(four, w))
    else:  # the widening kernels lost to oneDNN on a native-bf16 CPU: it keeps every batch
        assert native.kernel_max_rows == 0
    with cpu_kernels.use_isa("avx2"):  # forced AVX2 (WARSHA_CPU_ISA=avx2): today's oneDNN path
        assert DenseLinear(w, upcast=False, use_kernels=True).kernel_max_rows == 0
    more = torch.randn(NATIVE_BF16_KERNEL_MAX_ROWS + 1, 32).bfloat16()
    torch.testing.assert_close(native(more).float(), F.linear(more.float(), w.float()), rtol=1e-2, atol=1e-2)
    assert DenseLinear(w, upcast=False, use_kernels=False).kernel_max_rows == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("upcast,kernels", [(True, True), (False, True), (False, False), (True, False)])
def test_dense_linear_empty_batch_is_empty_on_every_path(dtype: torch.dtype, upcast: bool, kernels: bool) -> None:
    """A forward that samples no row hands the head 0 rows: every path returns [.., 0, N] in x's
    dtype without calling a kernel (on CUDA the CPU decode kernel took them: the first H200 run)."""
    lin = DenseLinear(torch.randn(48, 32).to(dtype), torch.randn(48).to(dtype), upcast=upcast, use_kernels=kernels)
    for shape in ((0, 32), (2, 0, 32)):
        y = lin(torch.empty(shape, dtype=dtype))
        assert y.shape == (*shape[:-1], 48) and y.dtype == dtype


def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 256), (9, 1024), (200, 64)])
def test_rms_norm_matches_transformers_formula(
    dtype: torch.dtype, shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's fused norm path (serve's C++ one has its own test in test_cpu_kernels.py)."""
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    torch.manual_seed(shape[0])
    x = (torch.randn(shape) * 4).to(dtype)
    w = torch.randn(shape[1]).to(dtype)
    got, ref = rms_norm(x, w, 1e-6), _hf_rms_norm(x, w, 1e-6)
    if dtype == torch.bfloat16:
        assert torch.equal(got, ref)
    else:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ratio", [0.5, 0.7, 0.9])
def test_split_by_context_partitions_and_bounds_padding(ratio: float) -> None:
    rng = random.Random(int(ratio * 10))
    lengths = [rng.randint(1, 900) for _ in range(60)]
    idx = list(range(100, 160))
    parts = split_by_context(idx, lengths, min_group=8, ratio=ratio)
    assert sorted(i for p in parts for i in p) == idx  # every sequence in exactly one group
    assert all(len(p) >= 8 for p in parts)
    assert len(parts) > 1
    for part in parts[:-1]:  # the last group may absorb a short tail below min_group
        ctx = sorted((lengths[i - 100] for i in part), reverse=True)
        # a group only grows past min_group with contexts within `ratio` of its longest
        assert all(c >= ratio * ctx[0] for c in ctx[8:])


def test_many_decode_sequences_split_into_groups_match_dense() -> None:
    """30 decode rows mixed with prefill chunks: several context groups, non-contiguous rows."""
    rng = random.Random(3)
    torch.manual_seed(3)
    heads, kv_heads, dim, bs, num_blocks = 8, 2, 16, 4, 600
    free = list(range(num_blocks))
    rng.shuffle(free)
    kc, vc = torch.randn(kv_heads, num_blocks * bs, dim), torch.randn(kv_heads, num_blocks * bs, dim)
    chunks, start = [], 0
    for i in range(34):
        ctx = rng.choice([rng.randint(1, 12), rng.randint(20, 70)])
        q_len = 1 if i % 9 else rng.randint(1, ctx)
        table = [free.pop() for _ in range(-(-ctx // bs))]
        chunks.append(SeqChunk(start, q_len, ctx, table))
        start += q_len
    q = torch.randn(start, heads, dim)
    backend = TorchPagedAttention(cpu_kernel=False)  # the torch path's grouping is under test
    meta = backend.build_metadata(chunks, bs)
    assert len([g for g in meta.groups if g.query_len == 1]) > 1
    got = backend.forward(
        q, kc[:, meta.slot_mapping].transpose(0, 1), vc[:, meta.slot_mapping].transpose(0, 1), kc, vc, meta, dim**-0.5
    )
    ref = paged_attention_reference(q, kc, vc, chunks, bs, dim**-0.5)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_bf16_attention_upcast_matches_float64_reference() -> None:
    """bf16 cache and queries, decode and prefill groups (and a fresh causal chunk): the float32
    path is within one bf16 rounding of float64 attention over the same bf16 values, and no
    farther from it than the bf16 path."""
    rng = random.Random(5)
    torch.manual_seed(5)
    heads, kv_heads, dim, bs, num_blocks = 8, 2, 32, 4, 300
    free = list(range(num_blocks))
    rng.shuffle(free)
    kc, vc = (
        torch.randn(kv_heads, num_blocks * bs, dim).bfloat16(),
        torch.randn(kv_heads, num_blocks * bs, dim).bfloat16(),
    )
    chunks, start = [], 0
    for i in range(12):
        ctx = rng.randint(20, 90)
        q_len = ctx if i == 0 else (1 if i % 3 else rng.randint(2, 6))
        table = [free.pop() for _ in range(-(-ctx // bs))]
        chunks.append(SeqChunk(start, q_len, ctx, table))
        start += q_len
    q = torch.randn(start, heads, dim).bfloat16()
    ref = paged_attention_reference(q.double(), kc.double(), vc.double(), chunks, bs, dim**-0.5)
    errors = {}
    for up in (True, False):
        backend = TorchPagedAttention(upcast_bf16=up, cpu_kernel=False)
        meta = backend.build_metadata(chunks, bs)
        got = backend.forward(
            q,
            kc[:, meta.slot_mapping].transpose(0, 1),
            vc[:, meta.slot_mapping].transpose(0, 1),
            kc,
            vc,
            meta,
            dim**-0.5,
        )
        assert got.dtype == torch.bfloat16
        errors[up] = (got.double() - ref).abs()
    assert bool((errors[True] <= _bf16_spacing(ref) + 1e-6).all())
    assert errors[True].mean() <= errors[False].mean()


def _decode_step_logits(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """Logits of ids[-1] computed as a one-row decode step after prefilling the rest."""
    from serve.model import ForwardBatch

    blocks, n = 4, len(ids)
    kv, table = model.new_kv_cache(blocks, 16), list(range(blocks))
    model.forward(
        ForwardBatch(
            torch.tensor(ids[:-1]), torch.arange(n - 1), [SeqChunk(0, n - 1, n - 1, table)], torch.tensor([n - 2])
        ),
        kv,
    )
    step = ForwardBatch(torch.tensor(ids[-1:]), torch.tensor([n - 1]), [SeqChunk(0, 1, n, table)], torch.tensor([0]))
    return model.forward(step, kv)[0]


def test_bf16_decode_with_and_without_serve_kernels_tracks_float32(tiny_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The kernel path and torch's fallback (no compiler, no AVX2) both stay within bf16 error of
    the float32 model on a decode step; only their rounding differs."""
    from serve.model import DecoderModel

    ids = list(range(7, 40))
    ref = _decode_step_logits(DecoderModel.load(tiny_dir, "float32"), ids)
    fast = _decode_step_logits(DecoderModel.load(tiny_dir, "bfloat16"), ids)
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    fallback_model = DecoderModel.load(tiny_dir, "bfloat16")
    assert fallback_model.layers[0].qkv.kernel_max_rows == 0
    fallback = _decode_step_logits(fallback_model, ids)
    for got in (fast, fallback):
        assert ((got - ref).norm() / ref.norm()).item() < 2e-2
        assert int(got.argmax()) == int(ref.argmax())
