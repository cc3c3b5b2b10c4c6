"""Paged attention against dense SDPA on random shapes and block layouts."""

import random

import pytest
import torch
import torch.nn.functional as F

from serve.attention import SeqChunk, TorchPagedAttention, get_backend, paged_attention_reference


def random_case(rng: random.Random, heads: int, kv_heads: int, dim: int, block_size: int, num_blocks: int):
    """Random sequences with shuffled block tables over one cache; returns dense per-seq K/V too."""
    n_seqs = rng.randint(1, 5)
    free = list(range(num_blocks))
    rng.shuffle(free)
    k_cache = torch.randn(kv_heads, num_blocks * block_size, dim)
    v_cache = torch.randn(kv_heads, num_blocks * block_size, dim)
    chunks, dense, start = [], [], 0
    for _ in range(n_seqs):
        ctx = rng.randint(1, 70)
        q_len = rng.choice([1, 1, ctx, rng.randint(1, ctx)])
        n_blocks = -(-ctx // block_size)
        table = [free.pop() for _ in range(n_blocks)]
        slots = [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        chunks.append(SeqChunk(start, q_len, ctx, table))
        dense.append((k_cache[:, slots].transpose(0, 1), v_cache[:, slots].transpose(0, 1)))
        start += q_len
    q = torch.randn(start, heads, dim)
    return q, k_cache, v_cache, chunks, dense


def dense_sdpa(q: torch.Tensor, chunks: list[SeqChunk], dense, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    for c, (k, v) in zip(chunks, dense):
        qc = q[c.query_start : c.query_start + c.query_len].transpose(0, 1)[None]
        rep = q.shape[1] // k.shape[1]
        kk = k.repeat_interleave(rep, 1).transpose(0, 1)[None]
        vv = v.repeat_interleave(rep, 1).transpose(0, 1)[None]
        q_pos = torch.arange(c.context_len - c.query_len, c.context_len)
        mask = torch.arange(c.context_len)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(qc, kk, vv, attn_mask=mask, scale=scale)
        out[c.query_start : c.query_start + c.query_len] = o[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("cpu_kernel", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_paged_matches_dense(seed: int, cpu_kernel: bool) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    heads, kv_heads = rng.choice([(4, 4), (4, 2), (8, 2), (6, 1)])
    dim, block_size = rng.choice([16, 32]), rng.choice([1, 4, 16])
    q, kc, vc, chunks, dense = random_case(
        rng, heads, kv_heads, dim, block_size, num_blocks=80 if block_size > 1 else 400
    )
    scale = dim**-0.5
    expected = dense_sdpa(q, chunks, dense, scale)
    backend = TorchPagedAttention(cpu_kernel=cpu_kernel)
    meta = backend.build_metadata(chunks, block_size)
    k_new, v_new = kc[:, meta.slot_mapping].transpose(0, 1), vc[:, meta.slot_mapping].transpose(0, 1)
    got = backend.forward(q, k_new, v_new, kc, vc, meta, scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    ref = paged_attention_reference(q, kc, vc, chunks, block_size, scale)
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-4)


def test_bf16_decode_batch() -> None:
    rng = random.Random(0)
    q, kc, vc, chunks, dense = random_case(rng, 8, 2, 32, 16, 80)
    q, kc, vc = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    backend = get_backend("cpu")
    meta = backend.build_metadata(chunks, 16)
    got = backend.forward(
        q, kc[:, meta.slot_mapping].transpose(0, 1), vc[:, meta.slot_mapping].transpose(0, 1), kc, vc, meta, 32**-0.5
    )
    ref = paged_attention_reference(q, kc, vc, chunks, 16, 32**-0.5)
    torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_bad_layout_and_device_named() -> None:
    with pytest.raises(ValueError, match="chunk"):
        TorchPagedAttention().build_metadata([SeqChunk(1, 1, 1, [0])], 16)
    with pytest.raises(ValueError, match="device"):
        get_backend("meta")
