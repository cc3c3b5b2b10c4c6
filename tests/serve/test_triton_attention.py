"""Triton paged attention (decode, prefill, whole backend) against the torch references.

Runs the kernels in Triton's interpreter on CPU (TRITON_INTERPRET=1 from tests/conftest.py) or
compiled on CUDA. Every kernel buffer is NaN-poisoned through `triton_common.alloc`, and cache
slots outside every context are NaN, so an element left unwritten or a key read past a context
length fails the comparison. The default cases cover every pair of (block size, head dim, GQA
ratio) with mixed decode/prefill batches; the full product runs under `-m slow`.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from serve.attention import TorchPagedAttention, paged_attention_reference
from tests.serve.triton_cases import PagedCase, kernel_device, nan_alloc, paged_case, to_device

# (context_len, query_len): decode steps (one crossing several 32-token partitions), a fresh
# prompt, chunks continuing a cached prefix across block boundaries, and a 1-token context.
MIXED = [(70, 1), (40, 40), (1, 1), (57, 23), (33, 1), (19, 3)]
# head_dim 256 with 4 query heads per KV head is Gemma 3 270M's shape
ALL_PAIRS = [(16, 64, 1), (32, 128, 4), (16, 128, 8), (32, 64, 8), (16, 64, 4), (32, 128, 1), (16, 256, 4)]
FULL = list(itertools.product((16, 32), (64, 128), (1, 4, 8)))
KV_HEADS = 2


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every output and scratch buffer of the kernels starts as NaN."""
    from serve.attention import triton_common

    monkeypatch.setattr(triton_common, "alloc", nan_alloc)


def torch_backend_output(case: PagedCase, block_size: int, scale: float) -> torch.Tensor:
    """TorchPagedAttention on the same chunks, in float32 on CPU, with unused slots zeroed.

    The torch backend gathers whole blocks (tails included) and masks scores, so it needs finite
    values there; zeroing slots that no context covers cannot change a correct result.
    """
    backend = TorchPagedAttention()
    meta = backend.build_metadata(case.chunks, block_size)
    kc, vc = (torch.nan_to_num(c.float().cpu()) for c in (case.k_cache, case.v_cache))
    return backend.forward(
        case.q.float().cpu(), case.k_new.float().cpu(), case.v_new.float().cpu(), kc, vc, meta, scale
    )


def run_triton(case: PagedCase, block_size: int, scale: float, partition_size: int = 32) -> torch.Tensor:
    """The Triton backend's forward on `case` (chosen through get_backend, as the model would)."""
    from serve.attention import get_backend

    device = kernel_device()
    backend = get_backend(device, prefer="triton", partition_size=partition_size)
    assert backend.name == "triton"
    case = to_device(case, device)
    meta = backend.build_metadata(case.chunks, block_size)
    return backend.forward(case.q, case.k_new, case.v_new, case.k_cache, case.v_cache, meta, scale).cpu()


def check_backend(block_size: int, dim: int, gqa: int, dtype: torch.dtype, seed: int) -> None:
    """Triton backend vs TorchPagedAttention on one mixed batch."""
    case = paged_case(seed, MIXED, KV_HEADS * gqa, KV_HEADS, dim, block_size, dtype=dtype, poison_unused=True)
    scale = dim**-0.5
    got = run_triton(case, block_size, scale)
    expected = torch_backend_output(case, block_size, scale)
    assert got.dtype == dtype and got.shape == case.q.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
        return
    # bf16: the kernels' P @ V dot reads P in tf32 (10 mantissa bits: each probability off by less
    # than 2**-10 of itself when truncated), so before the output's one bf16 rounding (at most
    # half an ulp, 2**-8 of the value) an element can be off by 2**-10 * sum_j p_j |v_j|: the
    # torch backend on |V| gives that sum. Bound: twice that term (margin), the rounding, 1e-4.
    # The first compiled H200 run was off by up to 0.0022 on 0.4% of elements against a flat
    # 1e-4 + 2**-8 |x|; a float64 model of the truncation stays within 0.87 of the unmargined bound.
    mass = torch_backend_output(_abs_v(case), block_size, scale)
    bound = 2**-9 * mass + 2**-8 * expected.abs() + 1e-4
    excess = (got.float() - expected).abs() - bound
    assert excess.max() <= 0, f"{int((excess > 0).sum())} elements past the bound, worst by {excess.max():.2e}"


def _abs_v(case: PagedCase) -> PagedCase:
    """`case` with |V| in the new values and the cache (NaN slots stay NaN)."""
    return dataclasses.replace(case, v_new=case.v_new.abs(), v_cache=case.v_cache.abs())


@pytest.mark.parametrize("block_size,dim,gqa", ALL_PAIRS)
def test_backend_matches_torch(block_size: int, dim: int, gqa: int) -> None:
    check_backend(block_size, dim, gqa, torch.float32, seed=block_size + dim + gqa)


def test_backend_bf16_matches_torch() -> None:
    check_backend(16, 128, 4, torch.bfloat16, seed=7)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,dim,gqa", FULL)
def test_backend_full_sweep(block_size: int, dim: int, gqa: int, dtype: torch.dtype) -> None:
    for seed in range(3):
        check_backend(block_size, dim, gqa, dtype, seed=100 * seed + block_size + dim + gqa)


def test_decode_partitions_merge_like_one_pass() -> None:
    """Many partitions (10, a non-power-of-two count) merge to the single-pass and reference result."""
    from serve.attention.triton_backend import TritonPagedAttention

    device = kernel_device()
    case = paged_case(3, [(300, 1), (7, 1), (129, 1)], 8, 2, 64, 16, poison_unused=True)
    ref = paged_attention_reference(
        case.q, torch.nan_to_num(case.k_cache), torch.nan_to_num(case.v_cache), case.chunks, 16, 0.125
    )
    dev = to_device(case, device)
    outs = []
    for partition in (32, 48, 512):
        backend = TritonPagedAttention(device, partition_size=partition)
        meta = backend.build_metadata(case.chunks, 16)
        assert meta.prefill is None and meta.decode is not None
        outs.append(backend.forward(dev.q, dev.k_new, dev.v_new, dev.k_cache, dev.v_cache, meta, 0.125).cpu())
    for out in outs:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_chunked_prefill_through_cache_writes() -> None:
    """Two sequences prefilled chunk by chunk (cache written by the Triton kernel), then decoded.

    Every step's output must equal one-shot causal attention over the whole sequence, which is
    how the engine uses the backend: write the chunk's K/V, then attend.
    """
    from serve.attention import SeqChunk
    from serve.attention.triton_backend import TritonPagedAttention

    device = kernel_device()
    heads, kv_heads, dim, bs = 8, 2, 64, 16
    lengths, chunking = [50, 37], [[20, 20, 9, 1], [16, 21]]
    full = paged_case(11, [(n, n) for n in lengths], heads, kv_heads, dim, bs)
    expected = torch_backend_output(full, bs, dim**-0.5)
    k_cache = torch.full_like(full.k_cache, float("nan")).to(device)
    v_cache = torch.full_like(full.v_cache, float("nan")).to(device)
    backend = TritonPagedAttention(device, partition_size=32)
    starts = [c.query_start for c in full.chunks]
    done = [0, 0]
    for step in range(max(len(c) for c in chunking)):
        chunks, rows = [], []
        for s, sizes in enumerate(chunking):
            if step < len(sizes):
                n = sizes[step]
                chunks.append(SeqChunk(len(rows), n, done[s] + n, full.chunks[s].block_table))
                rows += range(starts[s] + done[s], starts[s] + done[s] + n)
                done[s] += n
        idx = torch.tensor(rows)
        q, k, v = (x[idx].to(device) for x in (full.q, full.k_new, full.v_new))
        meta = backend.build_metadata(chunks, bs)
        backend.write_kv(k_cache, v_cache, meta, k, v)
        got = backend.forward(q, k, v, k_cache, v_cache, meta, dim**-0.5).cpu()
        torch.testing.assert_close(got, expected[idx], atol=2e-5, rtol=1e-4)
    assert done == lengths


def test_write_kv_skips_negative_slots_and_casts() -> None:
    """Written slots hold the values (cast to the cache dtype); slot -1 and all others stay NaN."""
    from serve.attention.triton_cache import write_kv

    device = kernel_device()
    gen = torch.Generator().manual_seed(0)
    kv_heads, dim, slots_total = 2, 64, 96
    slots = torch.randperm(slots_total, generator=gen)[:37]
    slots[[3, 17, 36]] = -1
    k = torch.randn(37, kv_heads, dim, generator=gen)
    v = torch.randn(37, kv_heads, dim, generator=gen)
    # exact ties between two bf16 values for half the rows: round-to-nearest-even is required
    ties = (torch.randn(19, kv_heads, dim, generator=gen).bfloat16().float().view(torch.int32) | 0x8000).view(
        torch.float32
    )
    k[::2], v[1::2] = ties[:19], ties[:18]
    k_cache = torch.full((kv_heads, slots_total, dim), float("nan"), dtype=torch.bfloat16, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    write_kv(k_cache, v_cache, slots.to(device), k.to(device), v.to(device))
    keep = slots >= 0
    for cache, src in ((k_cache.cpu(), k), (v_cache.cpu(), v)):
        assert torch.equal(cache[:, slots[keep]], src[keep].transpose(0, 1).bfloat16())
        untouched = torch.ones(slots_total, dtype=torch.bool)
        untouched[slots[keep]] = False
        assert cache[:, untouched].isnan().all()


def test_forward_rejects_mismatched_inputs() -> None:
    """Shapes that disagree with the metadata or the cache are named before any kernel runs."""
    from serve.attention.triton_backend import TritonPagedAttention

    device = kernel_device()
    case = to_device(paged_case(0, [(5, 5)], 4, 2, 64, 16), device)
    backend = TritonPagedAttention(device)
    meta = backend.build_metadata(case.chunks, 16)
    with pytest.raises(ValueError, match="tokens"):
        backend.forward(case.q[:4], case.k_new[:4], case.v_new[:4], case.k_cache, case.v_cache, meta, 0.125)
    with pytest.raises(ValueError, match="KV heads"):
        backend.forward(case.q[:, :3], case.k_new, case.v_new, case.k_cache, case.v_cache, meta, 0.125)
    with pytest.raises(ValueError, match="partition_size"):
        TritonPagedAttention(device, partition_size=40)


@pytest.mark.parametrize("window", [5, 24])
@pytest.mark.parametrize("block_size,dim,gqa", [(16, 64, 4), (16, 256, 4)])
def test_sliding_window_matches_reference(window: int, block_size: int, dim: int, gqa: int) -> None:
    """Decode partitions wholly before the window (context 70, window 5) merge with weight 0;
    prefill rows whose first key tiles are all outside the window stay finite."""
    from dataclasses import replace

    case = paged_case(window + dim, MIXED, KV_HEADS * gqa, KV_HEADS, dim, block_size, poison_unused=True)
    case.chunks = [replace(c, window=window) for c in case.chunks]
    scale = dim**-0.5
    kc, vc = (torch.nan_to_num(c) for c in (case.k_cache, case.v_cache))
    want = paged_attention_reference(case.q, kc, vc, case.chunks, block_size, scale)
    torch.testing.assert_close(run_triton(case, block_size, scale), want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(torch_backend_output(case, block_size, scale), want, rtol=2e-5, atol=2e-5)
