"""Rotary position embeddings and the scaling variants `config.json` may carry: the one copy.

Written from the formulas (RoFormer; PI; static and dynamic NTK; YaRN, arXiv 2309.00071; Llama
3.1's frequency-band rule), checked in tests against `transformers.modeling_rope_utils`. Each
variant is (inverse frequencies, attention factor); the attention factor multiplies cos and sin,
which is how YaRN's temperature sqrt(1/t) = 0.1 ln(s) + 1 enters the logits (its square scales
the attention logits, since it multiplies both q and k).

Why our own copy of this math: serving engines disagree on YaRN's attention scaling (``mscale``
vs ``attention_factor``) and on which length a factor multiplies, and the symptom (garbled or
looping output at long context) shows up far from the cause. Each rule is written once, as a
small function of plain numbers and a dtype: the engine builds its float32 table from them
(`RotaryEmbedding`), and ``context_ext`` checks in float64 the configs it writes by recomputing
the frequencies a loader will derive from them (`from_rope_parameters`). It lives here because
``serve`` imports neither the core nor the stage packages, while a stage package may import
``serve`` (docs/architecture.md).

Methods:

- ``linear`` (position interpolation, PI): every frequency divided by the factor s.
- ``ntk`` static ("NTK-aware"): the base theta raised to theta * s^(d/(d-2)), so the lowest
  frequency is interpolated by s and the highest is left alone.
- ``dynamic`` NTK: the same with s replaced by s*L/L0 - (s-1) for the current length L > L0.
- ``yarn`` (NTK-by-parts): per-dimension blend between interpolation and extrapolation, ramped
  between the dimensions that rotate beta_fast=32 and beta_slow=1 times over the original
  context, plus the temperature sqrt(1/t) = 0.1 ln(s) + 1 baked into cos/sin.
- ``llama3``: long wavelengths scaled by 1/s, short ones kept, the band between blended.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from serve import device_io

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0


@dataclass(frozen=True)
class RopeConfig:
    """Everything the RoPE math needs, normalised from either config.json spelling."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    max_position_embeddings: int = 2048
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = YARN_BETA_FAST
    beta_slow: float = YARN_BETA_SLOW
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0


def rope_config_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    """Read `rope_parameters` (transformers 5.x) or legacy `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json: rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("config.json: partial_rotary_factor != 1 is not supported by the Llama-family forward")
    max_pos = int(cfg.get("max_position_embeddings", 2048))

    def opt(name: str) -> float | None:
        return None if params.get(name) is None else float(params[name])

    return RopeConfig(
        rope_type=rope_type,
        theta=float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        factor=float(params.get("factor", 1.0) or 1.0),
        max_position_embeddings=max_pos,
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
        attention_factor=opt("attention_factor"),
        beta_fast=float(params.get("beta_fast") or YARN_BETA_FAST),
        beta_slow=float(params.get("beta_slow") or YARN_BETA_SLOW),
        mscale=opt("mscale"),
        mscale_all_dim=opt("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
    )


def rope_configs_by_layer_type(cfg: dict[str, Any], local_base: bool) -> dict[str, RopeConfig]:
    """RoPE of full-attention and sliding layers: one config for both, or (Gemma 3) one each.

    Gemma 3 keeps `rope_parameters` keyed by layer type (transformers 5) or, in older files,
    `rope_theta` (+ `rope_scaling`) for full layers and `rope_local_base_freq` for sliding ones.
    """
    params = cfg.get("rope_parameters") or {}
    if not local_base:
        shared = rope_config_from_hf(cfg)
        return {"full_attention": shared, "sliding_attention": shared}
    out: dict[str, RopeConfig] = {}
    for kind, theta_key, default_theta in (
        ("full_attention", "rope_theta", 1_000_000.0),
        ("sliding_attention", "rope_local_base_freq", 10_000.0),
    ):
        if kind in params:
            sub = dict(params[kind] or {"rope_type": "default"})
        elif kind == "full_attention":
            sub = dict(cfg.get("rope_scaling") or {"rope_type": "default"})
        else:
            sub = {"rope_type": "default"}
        sub.setdefault("rope_theta", cfg.get(theta_key, default_theta))
        out[kind] = rope_config_from_hf({**cfg, "rope_parameters": sub, "rope_scaling": None})
    return out


def rotary_dim(head_dim: int, partial_rotary_factor: float = 1.0) -> int:
    """Number of channels of each head that rotate (some models rotate only a fraction)."""
    return int(head_dim * partial_rotary_factor)


def default_inv_freq(dim: int, theta: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Unscaled RoPE: theta^(-2i/d) for i in [0, d/2), computed in ``dtype``."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype) / dim
    return 1.0 / (theta**exponents)


def linear_inv_freq(
    dim: int, theta: float, factor: float, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, float]:
    """Position interpolation: positions squeezed by ``factor`` (same as frequencies / factor)."""
    return default_inv_freq(dim, theta, dtype) / factor, 1.0


def ntk_theta(theta: float, dim: int, alpha: float) -> float:
    """The NTK-aware base: theta * alpha^(d/(d-2)) interpolates the lowest frequency by alpha."""
    return theta * alpha ** (dim / (dim - 2))


def ntk_inv_freq(
    dim: int, theta: float, factor: float, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, float]:
    """Static NTK-aware scaling: a fixed larger base, no attention scaling.

    Every loader reads this as plain RoPE with ``rope_theta = ntk_theta(...)``, which is why
    the stage writes it that way instead of relying on a rope type engines implement apart.
    """
    return default_inv_freq(dim, ntk_theta(theta, dim, factor), dtype), 1.0


def dynamic_ntk_alpha(factor: float, original: int, seq_len: int | None) -> float:
    """Dynamic NTK's effective alpha at ``seq_len``: 1 up to ``original``, then growing."""
    length = max(seq_len or original, original)
    return factor * length / original - (factor - 1)


def dynamic_ntk_inv_freq(
    dim: int, theta: float, factor: float, original: int, seq_len: int | None = None, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, float]:
    """Dynamic NTK: the base grows with the current length beyond the original context."""
    alpha = dynamic_ntk_alpha(factor, original, seq_len)
    return default_inv_freq(dim, ntk_theta(theta, dim, alpha), dtype), 1.0


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


def yarn_ramp(low: float, high: float, n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """0 at and below ``low``, 1 at and above ``high``, linear between (n entries)."""
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    return ((torch.arange(n, dtype=dtype) - low) / (high - low)).clamp(0.0, 1.0)


def yarn_inv_freq(
    dim: int,
    theta: float,
    factor: float,
    original: int,
    beta_fast: float = YARN_BETA_FAST,
    beta_slow: float = YARN_BETA_SLOW,
    truncate: bool = True,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """NTK-by-parts: interpolated frequencies where the ramp is 1, original ones where it is 0.

    Blended as transformers blends (through the extrapolation weight ``1 - ramp``), so that the
    engine's float32 table is bit-identical to the one transformers computes.
    """
    base = default_inv_freq(dim, theta, dtype)
    low, high = yarn_correction_range(dim, theta, original, beta_fast, beta_slow, truncate)
    keep = 1 - yarn_ramp(low, high, dim // 2, dtype)
    return base / factor * (1 - keep) + base * keep


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
    dtype: torch.dtype = torch.float64,
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
        dtype,
    )
    return inv, yarn_attention_factor(factor, mscale, mscale_all_dim, attention_factor)


def llama3_inv_freq(rope: RopeConfig, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Llama 3.1's rule: scale long wavelengths by 1/factor, keep short ones, blend the band between."""
    inv = default_inv_freq(dim, rope.theta, dtype)
    orig = rope.original_max_position_embeddings or rope.max_position_embeddings
    low_wavelen = orig / rope.low_freq_factor
    high_wavelen = orig / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (orig / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def inv_freq_and_attention_factor(
    rope: RopeConfig, head_dim: int, seq_len: int | None = None, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the cos/sin multiplier for `rope`, in `dtype`.

    float32 (the engine's table) computes as transformers does at load time, bit for bit.
    `seq_len` matters only for dynamic NTK, which stretches the base once a sequence grows past
    max_position_embeddings (and is the identity below it).
    """
    kind, theta, factor = rope.rope_type, rope.theta, rope.factor
    if kind == "default":
        return default_inv_freq(head_dim, theta, dtype), 1.0
    if kind == "linear":
        return linear_inv_freq(head_dim, theta, factor, dtype)
    if kind == "dynamic":
        return dynamic_ntk_inv_freq(head_dim, theta, factor, rope.max_position_embeddings, seq_len, dtype)
    if kind == "yarn":
        orig = rope.original_max_position_embeddings or rope.max_position_embeddings
        return yarn(
            head_dim, theta, factor, orig, rope.beta_fast, rope.beta_slow, rope.truncate,
            rope.mscale, rope.mscale_all_dim, rope.attention_factor, dtype,
        )  # fmt: skip
    if kind == "llama3":
        return llama3_inv_freq(rope, head_dim, dtype), 1.0
    raise ValueError(f"rope_type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")


def cos_sin(
    inv_freq: torch.Tensor, attention_factor: float, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [len(positions), head_dim] in float32, the attention factor folded in."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


class RotaryEmbedding:
    """Precomputed cos/sin table; dynamic NTK recomputes per sequence past the trained length."""

    def __init__(
        self, rope: RopeConfig, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        """Tables for positions [0, max_len) in `dtype`, kept on `device` (the model's): a step
        then gathers its rows where the positions already are, with no copy of the rows."""
        self.rope, self.head_dim, self.dtype = rope, head_dim, dtype
        inv, attn = inv_freq_and_attention_factor(rope, head_dim)
        cos, sin = cos_sin(inv, attn, torch.arange(max_len))
        self.cos, self.sin = cos.to(device, dtype), sin.to(device, dtype)

    def lookup(
        self, positions: torch.Tensor, seq_lens: list[tuple[int, int, int]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for `positions` (on the tables' device); `seq_lens` gives (start, count,
        length) per sequence chunk.

        For dynamic NTK each chunk uses its own sequence length, as transformers does for a
        single sequence, so that cached keys match a plain forward at the time they were written.
        """
        cos, sin = self.cos[positions], self.sin[positions]
        if self.rope.rope_type != "dynamic" or not seq_lens:
            return cos, sin
        for start, count, length in seq_lens:
            if length > self.rope.max_position_embeddings:
                with device_io.staging():  # frequencies from Python floats, staged like any step input
                    inv, attn = inv_freq_and_attention_factor(self.rope, self.head_dim, length)
                    inv = device_io.to_device(inv, positions.device)
                c, s = cos_sin(inv, attn, positions[start : start + count])
                cos[start : start + count], sin[start : start + count] = c.to(self.dtype), s.to(self.dtype)
        return cos, sin


def from_rope_parameters(
    params: dict[str, Any], head_dim: int, max_position_embeddings: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Frequencies and scaling (float64) for a transformers-5 ``rope_parameters`` dict, as loaders
    read it: what ``context_ext`` checks the configs it writes against.

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
    raise ValueError(f"rope_type {kind!r}: not supported here (supported: default, linear, dynamic, yarn)")
