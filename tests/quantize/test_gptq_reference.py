"""GPTQ against a brute-force float64 reference of its update rule, on one small layer.

The reference is written from the paper's optimal-brain-quantizer step, not from the fast
algorithm: quantize column i, spread its error ``(w_i - q_i) / [H^-1]_ii`` over the remaining
columns along row i of ``H^-1``, then remove column i from the problem by one step of Gaussian
elimination on ``H^-1`` (``H^-1 -= H^-1[:, i] H^-1[i, :] / H^-1[i, i]``). No Cholesky factor,
no lazy blocks, float64 everywhere: the fast implementation (upper Cholesky of ``H^-1``, blocks
of 128 columns, float32) must give the same codes, and both must beat round-to-nearest on the
layer-wise objective ``||W X - Q X||^2`` over the calibration inputs X.
"""

from __future__ import annotations

import pytest
import torch

from quantize.gptq import GPTQOptions, HessianAccumulator, gptq_quantize
from quantize.quantizer import QuantSpec, quantize_rtn


def _sym_grid(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, float]:
    """Per-row symmetric scale (rounded to fp16, as stored) and the fixed zero point."""
    maxq = 2**bits - 1
    scale = (2 * w.abs().amax(dim=1).clamp(min=1e-6) / maxq).half().double()
    return scale, float((maxq + 1) // 2)


def brute_force_gptq(w: torch.Tensor, x: torch.Tensor, bits: int, gs: int, damp: float) -> torch.Tensor:
    """Dequantized weights, float64, one column at a time with the full inverse Hessian."""
    w = w.double().clone()
    x = x.double()
    h = 2 * x.t() @ x / x.shape[0]
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=torch.float64)
    hinv = torch.linalg.inv(h)
    out = torch.zeros_like(w)
    maxq = 2**bits - 1
    scale = zero = None
    for i in range(w.shape[1]):
        if i % gs == 0:  # the group's grid comes from the weights as updated so far
            scale, zero = _sym_grid(w[:, i : i + gs], bits)
        q = torch.clamp(torch.round(w[:, i] / scale) + zero, 0, maxq)
        out[:, i] = (q - zero) * scale
        err = (w[:, i] - out[:, i]) / hinv[i, i]
        w[:, i + 1 :] -= err[:, None] * hinv[i, i + 1 :][None, :]
        hinv = hinv - hinv[:, i : i + 1] @ hinv[i : i + 1, :] / hinv[i, i]
    return out


def _layer_inputs(n: int, d: int, seed: int) -> torch.Tensor:
    """Correlated inputs with a few large channels, like a real layer's activations."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) @ (torch.randn(d, d, generator=g) / d**0.5) + 0.1 * torch.randn(
        n, d, generator=g
    )
    x[:, :3] *= 8
    return x


def _objective(w: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> float:
    return float((x.double() @ (w.double() - q.double()).t()).pow(2).sum())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gptq_matches_float64_brute_force_and_beats_rtn(seed: int) -> None:
    x = _layer_inputs(512, 96, seed)
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(100 + seed))
    spec = QuantSpec(4, 32, True)
    acc = HessianAccumulator(96)
    for chunk in x.split(100):  # the running mean over batches of unequal size
        acc.add(chunk)
    fast = gptq_quantize(w, acc.h, spec, GPTQOptions(damp=0.01, blocksize=64)).dequantize()
    ref = brute_force_gptq(w, x, 4, 32, 0.01)
    same = (fast.double() == ref).float().mean()
    assert same > 0.99, f"only {same:.1%} of the weights agree with the float64 reference"
    obj_fast, obj_ref = _objective(w, fast, x), _objective(w, ref, x)
    obj_rtn = _objective(w, quantize_rtn(w, spec).dequantize(), x)
    assert obj_fast == pytest.approx(obj_ref, rel=2e-3)
    assert obj_ref < 0.9 * obj_rtn and obj_fast < 0.9 * obj_rtn


def test_gptq_objective_below_rtn_on_a_real_model_layer() -> None:
    """The same objective on a tiny Llama's down_proj with its real calibration inputs."""
    from tests.quantize.quant_fixtures import tiny_model

    model = tiny_model(seed=5)
    fc = model.model.layers[0].mlp.down_proj
    seen: list[torch.Tensor] = []
    handle = fc.register_forward_pre_hook(lambda _m, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    ids = torch.randint(2, 640, (8, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    x = torch.cat(seen)
    acc = HessianAccumulator(x.shape[1])
    acc.add(x)
    spec = QuantSpec(4, 64, True)
    w = fc.weight.detach()
    fast = gptq_quantize(w, acc.h, spec, GPTQOptions()).dequantize()
    ref = brute_force_gptq(w, x, 4, 64, 0.01)
    obj_rtn = _objective(w, quantize_rtn(w, spec).dequantize(), x)
    assert _objective(w, fast, x) == pytest.approx(_objective(w, ref, x), rel=2e-3)
    assert _objective(w, fast, x) < 0.9 * obj_rtn
