"""GPTQ (Frantar et al., 2022): quantize one column at a time, push each column's rounding
error onto the columns not yet quantized, weighted by the inverse Hessian of the layer's
squared output error, ``H = 2/n * sum x x^T`` over calibration inputs.

Implemented from the paper's algorithm: damped Cholesky of ``H^-1`` (upper factor), lazy block
updates (the error of a block of columns reaches the rest of the matrix in one matmul), groups
whose grid is fixed when the group's first column is reached, optional act-order (columns in
order of decreasing ``diag(H)``) with optional static groups (grids fixed before reordering,
so ``g_idx`` stays ``i // group_size`` and every engine's fast path applies).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from quantize.quantizer import QuantizedLinear, QuantSpec, check_groups, find_params, quantize_codes

log = logging.getLogger("warsha.quantize")


class HessianAccumulator:
    """Running ``2/n * X^T X`` over every calibration token seen by one linear.

    Kept in float32 as a running mean, so samples of any count add up without overflow and
    memory is one ``[in, in]`` matrix per linear, never the activations themselves.
    """

    def __init__(self, in_features: int, device: torch.device | str = "cpu") -> None:
        self.h = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        """Fold a batch of inputs ``[..., in]`` into the running mean."""
        x = x.reshape(-1, x.shape[-1]).float()
        m = x.shape[0]
        self.h *= self.n / (self.n + m)
        self.n += m
        x = x * (2 / self.n) ** 0.5
        self.h += x.t() @ x


@dataclass
class GPTQOptions:
    """Algorithm options (the grid itself is a :class:`QuantSpec`)."""

    damp: float = 0.01
    blocksize: int = 128
    act_order: bool = False
    static_groups: bool = True
    max_damp: float = 1.0


def _inverse_cholesky(h: torch.Tensor, opts: GPTQOptions, name: str) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp*mean(diag H)*I)^-1``, damping more on failure."""
    damp = opts.damp
    mean_diag = torch.mean(torch.diag(h))
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    while True:
        try:
            lower = torch.linalg.cholesky(h + damp * mean_diag * eye)
            hinv = torch.cholesky_inverse(lower)
            return torch.linalg.cholesky(hinv, upper=True)
        except torch.linalg.LinAlgError:
            if damp * 10 > opts.max_damp + 1e-12:
                raise ValueError(
                    f"quantize.gptq: {name}: the Hessian is not positive definite even with damp"
                    f" {damp:g}; check the calibration data (too few samples, or constant inputs)"
                ) from None
            log.warning("quantize.gptq: %s: Cholesky failed with damp %g; retrying with damp %g", name, damp, damp * 10)
            damp *= 10


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: QuantSpec,
    opts: GPTQOptions,
    name: str = "linear",
    bias: torch.Tensor | None = None,
) -> QuantizedLinear:
    """Quantize ``weight[out, in]`` given its input Hessian ``[in, in]``."""
    problem = check_groups(weight.shape[1], spec)
    if problem:
        raise ValueError(f"quantize.gptq: {name}: {problem}")
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    cols = w.shape[1]
    gs = spec.group_size
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.arange(cols, device=w.device)
    static: list[tuple[torch.Tensor, torch.Tensor]] = []
    if opts.act_order:
        if opts.static_groups:
            static = [find_params(w[:, g : g + gs], spec) for g in range(0, cols, gs)]
        perm = torch.argsort(torch.diag(h), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
    hinv = _inverse_cholesky(h, opts, name)
    codes, scales, zeros, group_of = _quantize_columns(w, hinv, spec, opts, perm, static)
    inv = torch.argsort(perm)
    n_groups = cols // gs
    return QuantizedLinear(
        codes=codes[:, inv].to(torch.uint8).cpu(),
        scales=torch.stack([scales[g] for g in range(n_groups)], dim=1).cpu(),
        zeros=torch.stack([zeros[g] for g in range(n_groups)], dim=1).cpu(),
        g_idx=group_of[inv].to(torch.int32).cpu(),
        bits=spec.bits,
        group_size=gs,
        bias=None if bias is None else bias.detach().clone().cpu(),
    )


def _quantize_columns(
    w: torch.Tensor,
    hinv: torch.Tensor,
    spec: QuantSpec,
    opts: GPTQOptions,
    perm: torch.Tensor,
    static: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, dict[int, torch.Tensor], dict[int, torch.Tensor], torch.Tensor]:
    """The column loop on (possibly permuted) ``w``; returns codes in permuted order."""
    rows, cols = w.shape
    gs = spec.group_size
    codes = torch.zeros_like(w)
    group_of = torch.zeros(cols, dtype=torch.int64, device=w.device)
    scales: dict[int, torch.Tensor] = {}
    zeros: dict[int, torch.Tensor] = {}
    scale = zero = None
    for i1 in range(0, cols, opts.blocksize):
        i2 = min(i1 + opts.blocksize, cols)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        h1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if static:
                g = int(perm[col]) // gs
                scale, zero = static[g]
            else:
                g = col // gs
                if col % gs == 0:
                    ahead = torch.cat([w1[:, i:], w[:, i2:]], dim=1)[:, :gs]
                    scale, zero = find_params(ahead, spec)
            scales[g], zeros[g] = scale, zero
            group_of[col] = g
            q = quantize_codes(w1[:, i : i + 1], scale, zero, spec.maxq)[:, 0]
            codes[:, col] = q
            deq = (q - zero) * scale
            err = (w1[:, i] - deq) / h1[i, i]
            w1[:, i:] -= err[:, None] * h1[i, i:][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return codes, scales, zeros, group_of
