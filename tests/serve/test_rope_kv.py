"""serve's fused RoPE + K/V cache write (`csrc/rope_kv.cpp`) against transformers and a plain loop.

Reference: transformers' own `apply_rotary_pos_emb` on the same q, k, cos and sin (bit for bit,
in float32 and bf16: the kernel rounds each product and sum as torch's separate ops do), and a
Python loop storing every key and value row at its slot. Rows come from a strided split of a
fused q|k|v output, as the model passes them; prefill-sized inputs cross the kernel's task split.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from serve import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="serve's CPU kernels did not build here")


def _inputs(tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, slots: int) -> tuple:
    torch.manual_seed(tokens * 31 + dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    angles = torch.rand(tokens, dim // 2) * 50
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype) * 1.25  # YaRN-style attention factor
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(dtype) * 1.25
    where = torch.randperm(slots)[:tokens]
    return qkv, cos, sin, where


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens, heads, kv_heads, dim", [(1, 8, 2, 64), (3, 4, 4, 32), (70, 6, 2, 256), (1, 1, 1, 2), (5, 2, 1, 20)]
)
def test_rope_and_cache_write_equal_transformers_and_a_loop(
    dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, dim: int
) -> None:
    slots = 128
    qkv, cos, sin, where = _inputs(tokens, heads, kv_heads, dim, dtype, slots)
    qk, v = qkv.split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)  # strided rows, as the model has them
    k_cache = torch.full((kv_heads, slots, dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    q, k, v_rows = cpu_kernels.rope_write_kv(qk, v, cos, sin, where, k_cache, v_cache, heads)

    heads_first = qk.reshape(tokens, heads + kv_heads, dim).transpose(0, 1)[None]  # [1, H + Hkv, T, D]
    q_ref, k_ref = apply_rotary_pos_emb(heads_first[:, :heads], heads_first[:, heads:], cos[None], sin[None])
    assert torch.equal(q, q_ref[0].transpose(0, 1)) and torch.equal(k, k_ref[0].transpose(0, 1))
    assert torch.equal(v_rows, v.reshape(tokens, kv_heads, dim))
    untouched = torch.ones(slots, dtype=torch.bool)
    for t, s in enumerate(where.tolist()):
        untouched[s] = False
        for h in range(kv_heads):
            assert torch.equal(k_cache[h, s], k[t, h]) and torch.equal(v_cache[h, s], v_rows[t, h])
    assert bool(k_cache[:, untouched].isnan().all()) and bool(v_cache[:, untouched].isnan().all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_values_round_as_torch_does(dtype: torch.dtype) -> None:
    """NaN, infinities, values whose products overflow or land on a rounding tie: the vector
    lanes round (and keep NaN quiet) as torch's separate ops do."""
    qkv, cos, sin, where = _inputs(9, 2, 1, 64, dtype, 32)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.0e38, -3.0e38, 1.00390625, 0.0, -0.0])
    flat = qkv.view(-1)
    flat[: 8 * 40 : 5] = specials.repeat(8).to(dtype)
    cos.view(-1)[3::17] = torch.tensor(1.5, dtype=dtype)
    qk, v = qkv.split([3 * 64, 64], dim=-1)
    q, k, _ = cpu_kernels.rope_write_kv(
        qk, v, cos, sin, where, torch.zeros(1, 32, 64, dtype=dtype), torch.zeros(1, 32, 64, dtype=dtype), 2
    )
    heads_first = qk.reshape(9, 3, 64).transpose(0, 1)[None]
    q_ref, k_ref = apply_rotary_pos_emb(heads_first[:, :2], heads_first[:, 2:], cos[None], sin[None])
    torch.testing.assert_close(q, q_ref[0].transpose(0, 1), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(k, k_ref[0].transpose(0, 1), rtol=0, atol=0, equal_nan=True)


def test_results_do_not_depend_on_threads() -> None:
    qkv, cos, sin, where = _inputs(200, 4, 2, 64, torch.bfloat16, 256)
    qk, v = qkv.split([6 * 64, 2 * 64], dim=-1)
    outs = []
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            caches = torch.zeros(2, 2, 256, 64, dtype=torch.bfloat16)
            outs.append((*cpu_kernels.rope_write_kv(qk, v, cos, sin, where, caches[0], caches[1], 4), caches))
        finally:
            torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))


@pytest.mark.parametrize(
    "change, message",
    [
        ("slot", "outside the cache"),
        ("dtype", "share qk's dtype"),
        ("cos", r"cos/sin must be \[T, D\]"),
    ],
)
def test_bad_inputs_are_refused_before_any_write(change: str, message: str) -> None:
    qkv, cos, sin, where = _inputs(4, 2, 1, 16, torch.float32, 8)
    qk, v = qkv.split([3 * 16, 16], dim=-1)
    k_cache, v_cache = torch.zeros(1, 8, 16), torch.zeros(1, 8, 16)
    if change == "slot":
        where = torch.tensor([0, 1, 2, 8])
    elif change == "dtype":
        cos = cos.bfloat16()
    else:
        cos = cos[:, :8]
    with pytest.raises(RuntimeError, match=message):
        cpu_kernels.rope_write_kv(qk, v, cos, sin, where, k_cache, v_cache, 2)
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("tokens, heads, kv_heads, dim", [(1, 4, 1, 256), (70, 6, 2, 64), (5, 2, 1, 20)])
def test_qk_norms_in_the_call_give_the_bits_of_the_norm_then_rope(
    tokens: int, heads: int, kv_heads: int, dim: int
) -> None:
    """Gemma's q/k norms folded into the call (bf16, float32 1 + w per head row) against
    `serve.layers.Norm` on the heads, then the call without them: equal bit for bit, caches too."""
    from serve.layers import Norm

    slots = 128
    qkv, cos, sin, where = _inputs(tokens, heads, kv_heads, dim, torch.bfloat16, slots)
    qkv = qkv * 6  # rows far from unit RMS: the norm moves them
    qk, v = qkv.split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)
    gen = torch.Generator().manual_seed(dim)
    rows = 1.0 + torch.randn(heads + kv_heads, dim, generator=gen) * 0.3
    norm = Norm(rows, 1e-6, True, torch.bfloat16, prepared=True)
    caches = [torch.zeros(kv_heads, slots, dim, dtype=torch.bfloat16) for _ in range(4)]
    want = cpu_kernels.rope_write_kv(
        norm(qk.reshape(tokens, heads + kv_heads, dim)), v, cos, sin, where, *caches[:2], heads
    )
    got = cpu_kernels.rope_write_kv(qk, v, cos, sin, where, *caches[2:], heads, norm.weight, norm.eps)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match=r"qk_weight must be float32 \[H \+ Hkv, D\]"):
        cpu_kernels.rope_write_kv(qk, v, cos, sin, where, *caches[2:], heads, norm.weight[1:], norm.eps)
