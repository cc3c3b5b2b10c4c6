"""serve's paged attention for short chunks against a float64 brute-force loop, every ISA variant.

The reference walks each sequence position by position through its block table, with an explicit
softmax in float64 over the keys each query may see (causal, and inside a sliding window when
one is set). Block 0 of every cache is filled with NaN and never given to a sequence: padding and
handed-back table entries point at it, so any read outside a row's visible keys poisons the
output. Shapes cover GQA ratios 1-8, head sizes 16-256, contexts across the kernel's 64-key
tiles, query chunks of 1-16 tokens, bf16 and float32, and 1 or 2 threads. Every test runs once per
kernel variant this CPU runs (the AVX2 algorithm, and on AVX-512 hosts the AVX-512 one, plain
and with bf16 dot products, and on AMX hosts the tiles for tasks of 16 or more query rows: long
bf16 chunks in pieces, GQA groups of 16-token chunks); head sizes that are not a multiple of 64
stay on the AVX2 algorithm.
"""

from __future__ import annotations

import random

import pytest
import torch

from serve import cpu_kernels
from serve.attention import SeqChunk, TorchPagedAttention
from serve.attention.torch_ref import KERNEL_MAX_QUERY, KERNEL_PREFILL_PIECE

pytestmark = [
    pytest.mark.skipif(not cpu_kernels.available(), reason="serve's CPU kernels did not build here"),
    pytest.mark.usefixtures("isa"),  # every kernel variant the CPU runs (conftest)
]

NULL_BLOCK = -1


def make_case(
    seed: int, heads: int, kv_heads: int, dim: int, block_size: int, dtype: torch.dtype, window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[SeqChunk]]:
    """q, caches and chunks: up to 5 sequences, contexts 1-300, shuffled tables, block 0 poisoned."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 1 + 5 * (-(-300 // block_size))
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    shape = (kv_heads, num_blocks * block_size, dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k_cache[:, :block_size] = float("nan")
    v_cache[:, :block_size] = float("nan")
    chunks, start = [], 0
    for _ in range(rng.randint(1, 5)):
        ctx = rng.choice([1, 7, 64, 65, 130, rng.randint(1, 300)])
        q_len = min(ctx, rng.choice([1, 1, 2, 5, KERNEL_MAX_QUERY]))
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        if window is not None:  # blocks no query can see any more were handed back
            first_visible = max(0, ctx - q_len - window + 1) // block_size
            table = [NULL_BLOCK] * first_visible + table[first_visible:]
        chunks.append(SeqChunk(start, q_len, ctx, table, window=window))
        start += q_len
    q = torch.randn(start, heads, dim, generator=gen)
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), chunks


def brute_force(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunks: list[SeqChunk], bs: int, scale: float
) -> torch.Tensor:
    """float64, one query row and one head at a time."""
    heads, kv_heads = q.shape[1], k_cache.shape[0]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for c in chunks:
        for i in range(c.query_len):
            pos = c.context_len - c.query_len + i
            lo = 0 if c.window is None else max(0, pos - c.window + 1)
            slots = [c.block_table[p // bs] * bs + p % bs for p in range(lo, pos + 1)]
            for h in range(heads):
                kvh = h // (heads // kv_heads)
                keys = k_cache[kvh, slots].double()
                values = v_cache[kvh, slots].double()
                scores = keys @ q[c.query_start + i, h].double() * scale
                out[c.query_start + i, h] = torch.softmax(scores, 0) @ values
    return out


def bf16_tolerance(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    chunks: list[SeqChunk],
    bs: int,
    scale: float,
    ref: torch.Tensor,
) -> torch.Tensor:
    """How far the kernel's bf16 output may be from the float64 loop: one bf16 step of the
    result (its single rounding), plus, where the value pass multiplies bf16-rounded
    probabilities (`avx512_bf16`, head sizes that are a multiple of 64), their rounding: each
    probability moves by at most 2^-8 of itself, so an output by at most 2^-8 sum_j p_j |v_j|."""
    step = torch.exp2(torch.floor(torch.log2(ref.abs().clamp(min=1e-6))) - 7) + 1e-6
    if cpu_kernels.has_bf16_dot() and q.shape[-1] % 64 == 0:
        step = step + 2**-8 * brute_force(q, kc, vc.abs(), chunks, bs, scale)
    return step


def run_kernel(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, chunks: list[SeqChunk], bs: int, scale: float):
    backend = TorchPagedAttention(cpu_kernel=True)
    meta = backend.build_metadata(chunks, bs)
    assert meta.kernel_plan is not None, "short chunks must go to the kernel"
    k_new, v_new = kc[:, meta.slot_mapping].transpose(0, 1), vc[:, meta.slot_mapping].transpose(0, 1)
    return backend.forward(q, k_new, v_new, kc, vc, meta, scale)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "heads, kv_heads, dim", [(4, 4, 16), (8, 2, 64), (8, 1, 32), (16, 2, 128), (4, 1, 256), (6, 3, 24)]
)
def test_float32_matches_float64_brute_force(seed: int, heads: int, kv_heads: int, dim: int) -> None:
    bs = random.Random(seed).choice([1, 4, 16, 32])
    q, kc, vc, chunks = make_case(seed, heads, kv_heads, dim, bs, torch.float32)
    got = run_kernel(q, kc, vc, chunks, bs, dim**-0.5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), brute_force(q, kc, vc, chunks, bs, dim**-0.5), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window", [1, 5, 64, 100])
def test_sliding_window_reads_only_visible_keys(seed: int, window: int) -> None:
    q, kc, vc, chunks = make_case(seed, 8, 2, 32, 16, torch.float32, window=window)
    got = run_kernel(q, kc, vc, chunks, 16, 0.2)
    assert not got.isnan().any(), "a key outside the window was read"
    torch.testing.assert_close(got.double(), brute_force(q, kc, vc, chunks, 16, 0.2), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 2, 64), (4, 1, 256)])
def test_bf16_is_float32_math_rounded_once(seed: int, heads: int, kv_heads: int, dim: int) -> None:
    """bf16 q/cache are widened exactly; the float64 result rounded to bf16 is at most one bf16
    step away (plus the rounding of the probabilities where the value pass is in bf16)."""
    q, kc, vc, chunks = make_case(seed, heads, kv_heads, dim, 16, torch.bfloat16)
    got = run_kernel(q, kc, vc, chunks, 16, 0.125)
    assert got.dtype == torch.bfloat16
    ref = brute_force(q, kc, vc, chunks, 16, 0.125)
    assert ((got.double() - ref).abs() <= bf16_tolerance(q, kc, vc, chunks, 16, 0.125, ref)).all()


def test_same_result_on_one_and_two_threads() -> None:
    q, kc, vc, chunks = make_case(3, 16, 2, 64, 16, torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_kernel(q, kc, vc, chunks, 16, 0.125)
        torch.set_num_threads(2)
        two = run_kernel(q, kc, vc, chunks, 16, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_beside_decode_splits_between_kernel_and_torch(dtype: torch.dtype) -> None:
    """A step that prefills one sequence and decodes others: short chunks on the kernel, the long
    one on torch, all rows right; float16 (which the kernel does not take) runs all on torch."""
    q, kc, vc, chunks = make_case(5, 8, 2, 32, 16, torch.float32)
    long_len = KERNEL_MAX_QUERY + 9
    start = q.shape[0]
    table = [b for c in chunks for b in c.block_table]  # reuse blocks: only reads are tested
    chunks.append(SeqChunk(start, long_len, long_len, table[: -(-long_len // 16)]))
    q = torch.cat([q, torch.randn(long_len, 8, 32)])
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    backend = TorchPagedAttention(cpu_kernel=True)
    meta = backend.build_metadata(chunks, 16)
    assert meta.kernel_plan is not None and len(meta.kernel_plan.query_lens) == len(chunks) - 1
    assert [g.query_len for g in backend.torch_groups(meta)] == [long_len]
    k_new, v_new = kc[:, meta.slot_mapping].transpose(0, 1), vc[:, meta.slot_mapping].transpose(0, 1)
    got = backend.forward(q, k_new, v_new, kc, vc, meta, 0.2)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.double(), brute_force(q, kc, vc, chunks, 16, 0.2), atol=tol, rtol=tol)


def long_chunk_case(
    seed: int, heads: int, kv_heads: int, dim: int, window: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[SeqChunk]]:
    """Decode and verification chunks beside long ones, fresh and after cached context, bf16."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    bs, chunks, start = 16, [], 0
    free = list(range(1, 1 + 6 * 40))
    rng.shuffle(free)
    for ctx, q_len in [(rng.randint(20, 300), 1), (37, 37), (rng.randint(150, 400), 70), (200, 5), (130, 130)]:
        table = [free.pop() for _ in range(-(-ctx // bs))]
        if window is not None:  # blocks no query of the chunk can see any more were handed back
            first_visible = max(0, ctx - q_len - window + 1) // bs
            table = [NULL_BLOCK] * first_visible + table[first_visible:]
        chunks.append(SeqChunk(start, q_len, ctx, table, window=window))
        start += q_len
    shape = (kv_heads, (1 + 6 * 40) * bs, dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k_cache[:, :bs] = float("nan")
    v_cache[:, :bs] = float("nan")
    q = torch.randn(start, heads, dim, generator=gen)
    return q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), chunks


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("heads, kv_heads, dim, window", [(4, 1, 256, None), (8, 2, 64, 100), (8, 2, 32, None)])
def test_long_bf16_chunks_in_pieces_match_brute_force(
    isa: str, seed: int, heads: int, kv_heads: int, dim: int, window: int | None
) -> None:
    """Where the CPU has bf16 dot products, long bf16 chunks go to the kernel in pieces of
    KERNEL_PREFILL_PIECE tokens (each a chunk whose context ends at its last token); elsewhere,
    or with a head size the fast algorithm does not take, they stay on torch. Every row is
    within one bf16 step of the float64 loop, and no key outside a row's view is read."""
    q, kc, vc, chunks = long_chunk_case(seed, heads, kv_heads, dim, window)
    backend = TorchPagedAttention(cpu_kernel=True)
    meta = backend.build_metadata(chunks, 16)
    whole = meta.kernel_plan_all
    if cpu_kernels.has_bf16_dot():
        assert whole is not None
        expected = [  # (first row, tokens, context) of every piece
            (
                c.query_start + a,
                min(KERNEL_PREFILL_PIECE, c.query_len - a),
                c.context_len - c.query_len + min(a + KERNEL_PREFILL_PIECE, c.query_len),
            )
            for c in chunks
            for a in range(0, c.query_len, KERNEL_PREFILL_PIECE)
        ]
        assert (
            list(zip(whole.query_starts.tolist(), whole.query_lens.tolist(), whole.context_lens.tolist())) == expected
        )
    else:
        assert whole is None
    k_new, v_new = kc[:, meta.slot_mapping].transpose(0, 1), vc[:, meta.slot_mapping].transpose(0, 1)
    got = backend.forward(q, k_new, v_new, kc, vc, meta, dim**-0.5)
    assert not got.isnan().any(), "a key outside a row's view was read"
    ref = brute_force(q, kc, vc, chunks, 16, dim**-0.5)
    if whole is not None and dim % 64 == 0:  # the kernel: float32 math rounded once (probabilities in bf16)
        assert ((got.double() - ref).abs() <= bf16_tolerance(q, kc, vc, chunks, 16, dim**-0.5, ref)).all()
    else:  # torch's bf16 path rounds the probabilities to bf16 before the value product
        torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=2e-2)


def test_switched_off_kernel_plans_nothing() -> None:
    chunks = [SeqChunk(0, 1, 9, [4])]
    assert TorchPagedAttention(cpu_kernel=False).build_metadata(chunks, 16).kernel_plan is None


def test_bad_inputs_are_named_errors() -> None:
    q, kc, vc, chunks = make_case(0, 8, 2, 32, 16, torch.float32)
    plan = TorchPagedAttention(cpu_kernel=True).build_metadata(chunks, 16).kernel_plan
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_kernels.paged_attention(q, kc.bfloat16(), vc.bfloat16(), plan, 0.2)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        cpu_kernels.paged_attention(q[:, :7], kc[:2], vc[:2], plan, 0.2)
    short = cpu_kernels.AttentionPlan(
        plan.block_tables[:, :0], plan.context_lens, plan.query_starts, plan.query_lens, 16, None
    )
    with pytest.raises(RuntimeError, match="block table shorter"):
        cpu_kernels.paged_attention(q, kc, vc, short, 0.2)
