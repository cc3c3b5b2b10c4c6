"""serve's gated MLP activation (`csrc/act.cpp`) against float64 and against torch's bf16 ops.

References: the exact act(gate) in float64 (SiLU x sigmoid(x); tanh GELU 0.5 x (1 + tanh(y)), as
x sigmoid(2y)), rounded to bf16 and multiplied by up as torch's unfused ops round: the kernel must
land on that value or on the next bf16 step where the float32 activation sits next to a rounding
boundary. Run under every kernel variant the CPU supports (avx2 always). Against torch's own bf16
`act(gate) * up` (what the model ran before): SiLU equal but for a few
values in 10^4 (none seen), GELU for about one in 10^3 on gates of spread 3 (one bf16 step apart),
and GELU's far negative tail, where both are under 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from serve import cpu_kernels
from serve.layers import activation, gated_activation

pytestmark = [
    pytest.mark.skipif(not cpu_kernels.available(), reason="serve's CPU kernels did not build here"),
    pytest.mark.usefixtures("isa"),  # 8 lanes under avx2, 16 under the AVX-512 variants (conftest)
]

NAMES = ["silu", "gelu_pytorch_tanh"]


def _exact(gate: torch.Tensor, name: str) -> torch.Tensor:
    x = gate.double()
    if name == "silu":
        return x * torch.sigmoid(x)
    # 0.5 x (1 + tanh(y)) = x sigmoid(2y): the same function, without float64's 1 + tanh(y) = 0 far left
    return x * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))


def _step(v: torch.Tensor) -> torch.Tensor:
    """One bf16 step at each value (its spacing), at least the smallest normal's."""
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp(min=2.0**-126))) - 7)


def _rows(tokens: int, inter: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, 2 * inter, generator=g) * 3).bfloat16()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tokens, inter", [(1, 8), (7, 2048), (33, 20), (130, 96)])
def test_matches_float64_rounded_as_torch_rounds(name: str, tokens: int, inter: int) -> None:
    """Widths on and off the 8-lane vectors (20: a scalar tail), row counts across the task split."""
    gate_up = _rows(tokens, inter, tokens + inter)
    got = gated_activation(name)(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    act = _exact(gate, name).to(torch.bfloat16)  # one rounding of the exact activation
    ref = (act.double() * up.double()).to(torch.bfloat16).double()
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, inter)
    # the activation may round to the neighbouring bf16 value (the product then moves by that step
    # times |up|); an activation under 1e-30 |x| may be written as 0 (the far negative tail)
    flush = 2.0**-126 + 1e-30 * gate.double().abs()
    slack = (_step(act.double()) + flush) * up.double().abs() + _step(ref)
    assert bool(((got.double() - ref).abs() <= slack).all())


@pytest.mark.parametrize("name", NAMES)
def test_agrees_with_torchs_bf16_ops(name: str) -> None:
    gate_up = _rows(256, 2048, 7)
    gate, up = gate_up.chunk(2, dim=-1)
    torch_out = activation(name)(gate) * up
    got = cpu_kernels.gated_act_bf16(gate_up, name != "silu")
    differ = got != torch_out
    far_tail = gate.float() < -4  # torch's 1 + tanh(y) is a multiple of 6e-8 there; the kernel's is not
    # where torch's own tanh cancels (x in -4..-2) a value in 10^3 lands one bf16 step off; SiLU: none
    assert (differ & ~far_tail).float().mean().item() < (2e-3 if name != "silu" else 1e-4)
    step = _step(torch_out.double())
    off = (got.double() - torch_out.double()).abs()
    near = differ & ~far_tail
    assert bool((off[near] <= step[near] * (1 + up.double().abs()[near])).all())
    assert bool((off[far_tail] <= 1e-6 * up.double().abs()[far_tail] + 1e-30).all())


@pytest.mark.parametrize("name", NAMES)
def test_special_values_and_strided_rows(name: str) -> None:
    """inf, NaN, overflowing cubes, zeros of both signs; rows with a wider stride than their values."""
    buf = torch.zeros(4, 40, dtype=torch.bfloat16)
    gate_up = buf[:, :32]
    specials = [float("inf"), -float("inf"), float("nan"), 3.0e38, -3.0e38, 0.0, -0.0, 88.0, -88.0, 1e-30, -20.0, 20.0]
    gate_up[:, :16] = torch.tensor((specials * 2)[:16]).bfloat16()
    gate_up[:, 16:] = torch.linspace(-2, 2, 16).bfloat16()
    got = cpu_kernels.gated_act_bf16(gate_up, name != "silu")
    gate, up = gate_up.chunk(2, dim=-1)
    exact = _exact(gate.float(), name)
    finite = exact.isfinite()
    ref = (exact.to(torch.bfloat16).double() * up.double()).to(torch.bfloat16)
    torch.testing.assert_close(got[finite], ref[finite], rtol=2**-7, atol=1e-6)
    assert bool(got[gate.float().isnan()].isnan().all())
    assert bool((got[gate.float() == float("inf")] == up[gate.float() == float("inf")].float() * float("inf")).all())


@pytest.mark.parametrize("name", NAMES)
def test_the_model_takes_the_kernel_where_it_wins(name: str, isa: str) -> None:
    """GELU always, SiLU under the AVX-512 variants; SiLU under avx2 stays torch's (as fast there)."""
    gate_up = _rows(5, 64, 11)
    gate, up = gate_up.chunk(2, dim=-1)
    got = gated_activation(name)(gate_up)
    kernel = name != "silu" or isa != "avx2"
    want = cpu_kernels.gated_act_bf16(gate_up, name != "silu") if kernel else activation(name)(gate) * up
    assert torch.equal(got, want)


def test_other_dtypes_and_devices_run_torch() -> None:
    gate_up = torch.randn(3, 16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(gated_activation("silu")(gate_up), F.silu(gate) * up)


def test_refuses_what_it_cannot_take() -> None:
    with pytest.raises(RuntimeError, match="bf16 CPU rows"):
        cpu_kernels.gated_act_bf16(torch.randn(2, 8), True)
    with pytest.raises(RuntimeError, match="even width"):
        cpu_kernels.gated_act_bf16(torch.randn(2, 7).bfloat16(), True)
