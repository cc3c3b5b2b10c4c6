"""Rotary position embedding (RoPE) frequencies and attention scaling, as pure functions.

Why our own copy of this math: serving engines disagree on YaRN's attention scaling (``mscale``
vs ``attention_factor``) and on which length a factor multiplies, and the symptom (garbled or
looping output at long context) shows up far from the cause. Writing each rule once, as a
small function of plain numbers, lets the tests pin every variant against transformers'
``ROPE_INIT_FUNCTIONS`` and lets the stage check the config it wrote by recomputing the
frequencies that a loader will derive from it.

All functions compute in float64 and return float64 tensors of ``rotary_dim // 2`` inverse
frequencies plus the factor by which cos/sin are multiplied (``attention_scaling``; the
attention logits are scaled by its square because it multiplies both q and k).

Methods:

- ``linear`` (position interpolation, PI): every frequency divided by the factor s.
- ``ntk`` static ("NTK-aware"): the base theta raised to theta * s^(d/(d-2)), so the lowest
  frequency is interpolated by s and the highest is left alone.
- ``dynamic`` NTK: the same with s replaced by s*L/L0 - (s-1) for the current length L > L0.
- ``yarn`` (NTK-by-parts, arXiv 2309.00071): per-dimension blend between interpolation and
  extrapolation, ramped between the dimensions that rotate beta_fast=32 and beta_slow=1 times
  over the original context, plus the temperature sqrt(1/t) = 0.1 ln(s) + 1 baked into cos/sin.
"""

from __future__ import annotations

import math
from typing import Any

import torch

YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0


def rotary_dim(head_dim: int, partial_rotary_factor: float = 1.0) -> int:
    """Number of channels of each head that rotate (some models rotate only a fraction)."""
    return int(head_dim * partial_rotary_factor)


def default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """Unscaled RoPE: theta^(-2i/d) for i in [0, d/2)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    return 1.0 / (theta**exponents)


def linear_inv_freq(dim: int, theta: float, factor: float) -> tuple[torch.Tensor, float]:
    """Position interpolation: positions squeezed by ``factor`` (same as frequencies / factor)."""
    return default_inv_freq(dim, theta) / factor, 1.0


def ntk_theta(theta: float, dim: int, alpha: float) -> float:
    """The NTK-aware base: theta * alpha^(d/(d-2)) interpolates the lowest frequency by alpha."""
    return theta * alpha ** (dim / (dim - 2))


def ntk_inv_freq(dim: int, theta: float, factor: float) -> tuple[torch.Tensor, float]:
    """Static NTK-aware scaling: a fixed larger base, no attention scaling.

    Every loader reads this as plain RoPE with ``rope_theta = ntk_theta(...)``, which is why
    the stage writes it that way instead of relying on a rope type engines implement apart.
    """
    return default_inv_freq(dim, ntk_theta(theta, dim, factor)), 1.0


def dynamic_ntk_alpha(factor: float, original: int, seq_len: int | None) -> float:
    """Dynamic NTK's effective alpha at ``seq_len``: 1 up to ``original``, then growing."""
    length = max(seq_len or original, original)
    return factor * length / original - (factor - 1)


def dynamic_ntk_inv_freq(
    dim: int, theta: float, factor: float, original: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Dynamic NTK: the base grows with the current length beyond the original context."""
    alpha = dynamic_ntk_alpha(factor, original, seq_len)
    return default_inv_freq(dim, ntk_theta(theta, dim, alpha)), 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's temperature term 0.1 * mscale * ln(s) + 1 (1 when there is no extension)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(
    factor: float,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
    attention_factor: float | None = None,
) -> float:
    """The factor applied to cos/sin, following the precedence real checkpoints rely on.

    An explicit ``attention_factor`` wins. DeepSeek-style configs carry both ``mscale`` and
    ``mscale_all_dim`` and mean their ratio (which is 1 when they are equal: the model then
    applies its temperature inside attention instead). Otherwise the paper's 0.1 ln s + 1.
    """
    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn_correction_dim(rotations: float, dim: int, theta: float, original: int) -> float:
    """The (fractional) dimension index whose wavelength fits ``rotations`` times in ``original``."""
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_correction_range(
    dim: int, theta: float, original: int, beta_fast: float, beta_slow: float, truncate: bool
) -> tuple[float, float]:
    """Dimensions below ``low`` extrapolate (rotate fast), above ``high`` interpolate.

    ``truncate`` (the default everywhere) snaps the bounds outward to whole dimensions; some
    checkpoints (gpt-oss) set it false and keep the fractional bounds.
    """
    low = yarn_correction_dim(beta_fast, dim, theta, original)
    high = yarn_correction_dim(beta_slow, dim, theta, original)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_ramp(low: float, high: float, n: int) -> torch.Tensor:
    """0 at and below ``low``, 1 at and above ``high``, linear between (n entries)."""
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    return ((torch.arange(n, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)


def yarn_inv_freq(
    dim: int,
    theta: float,
    factor: float,
    original: int,
    beta_fast: float = YARN_BETA_FAST,
    beta_slow: float = YARN_BETA_SLOW,
    truncate: bool = True,
) -> torch.Tensor:
    """NTK-by-parts: interpolated frequencies where the ramp is 1, original ones where it is 0."""
    base = default_inv_freq(dim, theta)
    low, high = yarn_correction_range(dim, theta, original, beta_fast, beta_slow, truncate)
    interpolate = yarn_ramp(low, high, dim // 2)
    return base / factor * interpolate + base * (1.0 - interpolate)


def yarn(
    dim: int,
    theta: float,
    factor: float,
    original: int,
    beta_fast: float | None = None,
    beta_slow: float | None = None,
    truncate: bool | None = None,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
    attention_factor: float | None = None,
) -> tuple[torch.Tensor, float]:
    """YaRN frequencies and attention scaling; ``None`` (or 0) options take the paper's values."""
    inv = yarn_inv_freq(
        dim,
        theta,
        factor,
        original,
        beta_fast or YARN_BETA_FAST,
        beta_slow or YARN_BETA_SLOW,
        True if truncate is None else truncate,
    )
    return inv, yarn_attention_factor(factor, mscale, mscale_all_dim, attention_factor)


def from_rope_parameters(
    params: dict[str, Any], head_dim: int, max_position_embeddings: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Frequencies and scaling for a transformers-5 ``rope_parameters`` dict, as loaders read it.

    ``max_position_embeddings`` matters twice: YaRN without ``factor`` infers it from
    max/original, and dynamic NTK measures its growth from it (so a dynamic config must keep
    the original length there).
    """
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", 10000.0))
    dim = rotary_dim(head_dim, float(params.get("partial_rotary_factor", 1.0)))
    if kind == "default":
        return default_inv_freq(dim, theta), 1.0
    if kind == "linear":
        return linear_inv_freq(dim, theta, float(params["factor"]))
    if kind == "dynamic":
        return dynamic_ntk_inv_freq(dim, theta, float(params["factor"]), max_position_embeddings, seq_len)
    if kind == "yarn":
        original = int(params["original_max_position_embeddings"])
        factor = params.get("factor") or max_position_embeddings / original
        return yarn(
            dim,
            theta,
            float(factor),
            original,
            params.get("beta_fast"),
            params.get("beta_slow"),
            bool(params.get("truncate", True)),
            params.get("mscale"),
            params.get("mscale_all_dim"),
            params.get("attention_factor"),
        )
    raise ValueError(f"rope_type {kind!r}: not supported by context_ext (supported: default, linear, dynamic, yarn)")
