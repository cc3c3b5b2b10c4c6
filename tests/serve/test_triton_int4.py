"""Triton int4 dequant-GEMM against `serve.quant.gptq_dequantize` + matmul in float64.

Packed tensors are random words (every nibble pattern, negative int32 words included) or a
real GPTQ packing of a weight by the brute-force packer in tests/serve/gptq_pack.py. The
output buffer is NaN-poisoned, so every element must be written by the kernel.
"""

from __future__ import annotations

import pytest
import torch

from serve.quant import default_g_idx, gptq_dequantize
from tests.serve.gptq_pack import quantize_to_gptq
from tests.serve.triton_cases import kernel_device, nan_alloc


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMM's output starts as NaN."""
    from serve.attention import triton_common

    monkeypatch.setattr(triton_common, "alloc", nan_alloc)


def random_gptq(k: int, n: int, group_size: int, seed: int, act_order: bool = False) -> dict[str, torch.Tensor]:
    """Random packed words and fp16 scales; g_idx contiguous or a random act-order map."""
    gen = torch.Generator().manual_seed(seed)
    groups = k // group_size
    word = lambda *shape: torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(torch.int32)  # noqa: E731
    g_idx = default_g_idx(k, group_size)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)].contiguous()
    return {
        "qweight": word(k // 8, n),
        "qzeros": word(groups, n // 8),
        "scales": (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).half(),
        "g_idx": g_idx,
    }


def reference(
    x: torch.Tensor, t: dict[str, torch.Tensor], bias: torch.Tensor | None = None, fmt: str = "gptq"
) -> torch.Tensor:
    """float64 x @ W^T with W from the torch reference dequantization."""
    w = gptq_dequantize(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], fmt).double()
    y = x.double() @ w.T
    return y if bias is None else y + bias.double()


def run(x: torch.Tensor, t: dict[str, torch.Tensor], **kwargs) -> torch.Tensor:
    """int4_matmul on the kernel device, back on CPU."""
    from serve.triton_int4 import int4_matmul

    device = kernel_device()
    moved = {name: v.to(device) for name, v in t.items()}
    bias = kwargs.pop("bias", None)
    out = int4_matmul(
        x.to(device),
        moved["qweight"],
        moved["qzeros"],
        moved["scales"],
        moved["g_idx"],
        bias=None if bias is None else bias.to(device),
        **kwargs,
    )
    return out.cpu()


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 5])
def test_int4_matches_float64_reference(group_size: int, m: int) -> None:
    k, n = 256, 96  # N not a multiple of the 64-wide tile: the edge tile is masked
    t = random_gptq(k, n, group_size, seed=group_size + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = run(x, t)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), reference(x, t), atol=1e-4, rtol=1e-4)


def test_int4_act_order_bias_and_v2_zeros() -> None:
    """A shuffled g_idx is followed as stored; bias is added; gptq_v2 zeros are not offset."""
    k, n = 128, 64
    t = random_gptq(k, n, 32, seed=5, act_order=True)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(run(x, t, bias=bias).double(), reference(x, t, bias), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        run(x, t, checkpoint_format="gptq_v2").double(), reference(x, t, fmt="gptq_v2"), atol=1e-4, rtol=1e-4
    )


def test_int4_bf16_input_real_gptq_packing() -> None:
    """bf16 activations ([batch, seq, K]) on a weight packed by the brute-force GPTQ packer."""
    k, n, group = 128, 32, 64
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.05
    t = quantize_to_gptq(w, group, act_order=True, seed=3)
    x = torch.randn(2, 9, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    got = run(x, t)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 9, n)
    expected = reference(x.reshape(-1, k), t).reshape(2, 9, n)
    # one bf16 rounding of the output (8 bits of mantissa) on top of an exact float32 sum
    torch.testing.assert_close(got.double(), expected, atol=2e-3, rtol=8e-3)
    assert (got.double() - expected).abs().max() > 0  # rounded, not a float32 copy of the reference


def test_int4_linear_checks_layout() -> None:
    """Malformed tensors are named before any kernel runs."""
    from serve.triton_int4 import Int4TritonLinear, int4_matmul

    device = kernel_device()
    t = {name: v.to(device) for name, v in random_gptq(64, 16, 32, seed=0).items()}
    linear = Int4TritonLinear(t["qweight"], t["qzeros"], t["scales"], None, group_size=32)
    x = torch.randn(2, 64, device=device)
    torch.testing.assert_close(
        linear(x).cpu().double(), reference(x.cpu(), {k: v.cpu() for k, v in t.items()}), atol=1e-4, rtol=1e-4
    )
    with pytest.raises(ValueError, match="g_idx holds groups"):
        Int4TritonLinear(t["qweight"], t["qzeros"], t["scales"], t["g_idx"] + 1, group_size=32)
    with pytest.raises(ValueError, match="scales"):
        int4_matmul(x, t["qweight"], t["qzeros"], t["scales"][:1], t["g_idx"])
    with pytest.raises(ValueError, match="input features"):
        int4_matmul(x[:, :32], t["qweight"], t["qzeros"], t["scales"], t["g_idx"])
    with pytest.raises(ValueError, match="checkpoint_format"):
        int4_matmul(x, t["qweight"], t["qzeros"], t["scales"], t["g_idx"], checkpoint_format="awq")
