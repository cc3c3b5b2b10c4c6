"""The group-wise integer grid shared by RTN, GPTQ and AWQ.

A weight ``W[out, in]`` is cut along the input dimension into groups of ``group_size``; each
(output row, group) pair gets a scale ``s`` and an integer zero point ``z`` and each weight an
integer code ``q`` in ``[0, 2**bits - 1]``, so that ``w ~= (q - z) * s``. Scales are rounded to
fp16 *before* codes are computed because fp16 is what the checkpoint stores: the fake-quantized
weights used during calibration are then bit-identical to what a loader reconstructs.

Asymmetric zero points are kept in ``[1, 2**bits - 1]``: the GPTQ v1 checkpoint stores ``z - 1``
in ``bits`` bits, so a zero of 0 cannot be written (it would wrap to all ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MIN_SCALE = 1e-6  # representable (as a subnormal) in fp16; keeps division finite


@dataclass(frozen=True)
class QuantSpec:
    """Bits, group size and symmetry of the integer grid."""

    bits: int = 4
    group_size: int = 128
    sym: bool = True

    @property
    def maxq(self) -> int:
        """The largest code."""
        return 2**self.bits - 1


@dataclass
class QuantizedLinear:
    """Integer codes and group parameters of one linear, in the original column order.

    ``codes`` uint8 ``[out, in]``; ``scales`` float32 ``[out, n_groups]`` (exact fp16 values);
    ``zeros`` int32 ``[out, n_groups]``; ``g_idx`` int32 ``[in]`` maps each input column to its
    group (``i // group_size`` except under GPTQ act-order without static groups).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    bits: int
    group_size: int
    bias: torch.Tensor | None = None

    def cpu(self) -> "QuantizedLinear":
        """The same codes with every tensor on the CPU (packing and export run there)."""
        move = lambda t: None if t is None else t.cpu()  # noqa: E731
        return QuantizedLinear(
            move(self.codes),
            move(self.scales),
            move(self.zeros),
            move(self.g_idx),
            self.bits,
            self.group_size,
            move(self.bias),
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the codes stand for."""
        g = self.g_idx.long()
        return (self.codes.float() - self.zeros[:, g].float()) * self.scales[:, g]


def find_params(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (fp16-exact float32) and zero (int32) per row of ``w[rows, cols]``.

    The grid always contains 0 (GPTQ's convention), so exact zeros stay exact.
    """
    w = w.float()
    maxq = spec.maxq
    if spec.sym:
        amax = w.abs().amax(dim=1).clamp(min=_MIN_SCALE)
        scale = 2 * amax / maxq
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        xmin = w.amin(dim=1).clamp(max=0)
        xmax = w.amax(dim=1).clamp(min=0)
        flat = (xmax - xmin) <= 0
        xmin = torch.where(flat, torch.full_like(xmin, -1.0), xmin)
        xmax = torch.where(flat, torch.ones_like(xmax), xmax)
        scale = (xmax - xmin) / maxq
        zero = torch.round(-xmin / scale)
        low = zero < 1  # all weights >= 0: move the grid by one step so that z >= 1
        scale = torch.where(low, xmax / (maxq - 1), scale)
        zero = torch.where(low, torch.ones_like(zero), zero)
    scale = scale.clamp(min=_MIN_SCALE).half().float()
    return scale, zero.clamp(0, maxq).to(torch.int32)


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Codes of ``w[rows, k]`` on the grid of per-row ``scale``/``zero`` (broadcast on the right)."""
    if scale.dim() == 1:
        scale, zero = scale[:, None], zero[:, None]
    return torch.clamp(torch.round(w.float() / scale) + zero, 0, maxq)


def check_groups(in_features: int, spec: QuantSpec) -> str | None:
    """Why ``spec`` cannot quantize a linear with ``in_features`` inputs, or None."""
    if in_features % spec.group_size:
        return f"group_size {spec.group_size} does not divide in_features {in_features}"
    return None


def quantize_rtn(weight: torch.Tensor, spec: QuantSpec, bias: torch.Tensor | None = None) -> QuantizedLinear:
    """Round-to-nearest: per-group min/max (or absmax) grid, every weight rounded alone."""
    out_f, in_f = weight.shape
    problem = check_groups(in_f, spec)
    if problem:
        raise ValueError(f"quantize: {problem}")
    n_groups = in_f // spec.group_size
    w = weight.float().reshape(out_f * n_groups, spec.group_size)
    scale, zero = find_params(w, spec)
    codes = quantize_codes(w, scale, zero, spec.maxq).reshape(out_f, in_f)
    g_idx = torch.arange(in_f, dtype=torch.int32) // spec.group_size
    return QuantizedLinear(
        codes=codes.to(torch.uint8),
        scales=scale.reshape(out_f, n_groups),
        zeros=zero.reshape(out_f, n_groups),
        g_idx=g_idx,
        bits=spec.bits,
        group_size=spec.group_size,
        bias=None if bias is None else bias.detach().clone(),
    )


def fake_quantize(weight: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """RTN quantize-dequantize in float32 (used inside AWQ's searches)."""
    return quantize_rtn(weight, spec).dequantize()
