"""The residual step between branches in one pass (`layers.add_norm`, `csrc/norm.cpp`) against
the three calls it replaces: x + out_norm(y) with torch's bf16 add, then next_norm of the sum,
each norm serve's own (whose formula tests/serve/test_cpu_kernels.py checks against torch's).
Both families' norms (Gemma's float32 1 + w, one rounding; Llama's bf16 weight, two), with and
without the branch norm and the next norm, hidden sizes off the 8-wide vectors, 0 rows: the
same bits, on 1 and 2 threads."""

from __future__ import annotations

import pytest
import torch

from serve import cpu_kernels
from serve.layers import Norm, add_norm

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="serve's CPU kernels did not build here")


def _norm(hidden: int, plus_one: bool, seed: int) -> Norm:
    w = torch.randn(hidden, generator=torch.Generator().manual_seed(seed)) * 0.3
    return Norm(w if plus_one else 1.0 + w, 1e-6, plus_one, torch.bfloat16)


@pytest.mark.parametrize("shape", [(9, 640), (37, 100), (2, 3, 13), (0, 64)])
@pytest.mark.parametrize("plus_one", [True, False])
@pytest.mark.parametrize("with_out_norm, with_next_norm", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("threads", [1, 2])
def test_add_norm_gives_the_bits_of_the_three_calls(
    shape: tuple[int, ...], plus_one: bool, with_out_norm: bool, with_next_norm: bool, threads: int
) -> None:
    if with_out_norm and not plus_one:
        pytest.skip("only Gemma (1 + w) norms the branch output")
    gen = torch.Generator().manual_seed(shape[-1] + 7 * len(shape))
    x = (torch.randn(shape, generator=gen) * 4).bfloat16()
    y = (torch.randn(shape, generator=gen) * 30).bfloat16()
    out_norm = _norm(shape[-1], plus_one, 1) if with_out_norm else None
    next_norm = _norm(shape[-1], plus_one, 2) if with_next_norm else None
    want_x = x + (y if out_norm is None else out_norm(y))
    want_h = None if next_norm is None else next_norm(want_x)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got_x, got_h = add_norm(x, y, out_norm, next_norm)
    finally:
        torch.set_num_threads(before)
    assert got_x.dtype == torch.bfloat16 and torch.equal(got_x, want_x)
    assert (got_h is None) == (want_h is None)
    if want_h is not None:
        assert torch.equal(got_h, want_h)


def test_float32_rows_take_the_torch_calls() -> None:
    x, y = torch.randn(5, 24), torch.randn(5, 24)
    norm = Norm(torch.randn(24) * 0.3, 1e-6, True, torch.float32)
    got_x, got_h = add_norm(x, y, norm, norm)
    want = x + norm(y)
    assert torch.equal(got_x, want) and torch.equal(got_h, norm(want))


def test_the_kernel_names_bad_inputs() -> None:
    x = torch.randn(3, 16).bfloat16()
    with pytest.raises(RuntimeError, match="x and y must have one shape"):
        cpu_kernels.add_rms_norm_bf16(x, x[:2], None, None, 1e-6)
    with pytest.raises(RuntimeError, match=r"w_y must be float32 \[16\]"):
        cpu_kernels.add_rms_norm_bf16(x, x, torch.ones(16).bfloat16(), None, 1e-6)
    with pytest.raises(RuntimeError, match=r"w_x must be float32 or bf16 \[16\]"):
        cpu_kernels.add_rms_norm_bf16(x, x, None, torch.ones(8), 1e-6)
