"""Rotary position embeddings and the scaling variants `config.json` may carry.

Written from the formulas (RoFormer; PI; dynamic NTK; YaRN, arXiv 2309.00071; Llama 3.1's
frequency-band rule), checked in tests against `transformers.modeling_rope_utils`. Each variant
is (inverse frequencies, attention factor); the attention factor multiplies cos and sin, which
is how YaRN's temperature sqrt(1/t) = 0.1 ln(s) + 1 enters the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Everything the RoPE math needs, normalised from either config.json spelling."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    max_position_embeddings: int = 2048
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
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
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
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


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """theta^(-2i/dim) for i < dim/2, in float32."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """NTK-by-parts: interpolate low frequencies, keep high ones, ramp in between."""
    factor = rope.factor
    orig = rope.original_max_position_embeddings or rope.max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rope.attention_factor
    if attn is None:
        if rope.mscale and rope.mscale_all_dim:
            attn = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attn = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = _base_inv_freq(rope.theta, dim)
    interpolated = extrapolated / factor
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep, float(attn)


def _llama3(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Scale long wavelengths by 1/factor, keep short ones, blend the band in between."""
    inv = _base_inv_freq(rope.theta, dim)
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
    rope: RopeConfig, head_dim: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the cos/sin multiplier for `rope`.

    `seq_len` matters only for dynamic NTK, which stretches the base once a sequence grows past
    max_position_embeddings (and is the identity below it).
    """
    kind = rope.rope_type
    if kind == "default":
        return _base_inv_freq(rope.theta, head_dim), 1.0
    if kind == "linear":
        return _base_inv_freq(rope.theta, head_dim) / rope.factor, 1.0
    if kind == "dynamic":
        max_pos = rope.max_position_embeddings
        length = max(seq_len or max_pos, max_pos)
        base = rope.theta * ((rope.factor * length / max_pos) - (rope.factor - 1)) ** (head_dim / (head_dim - 2))
        return _base_inv_freq(base, head_dim), 1.0
    if kind == "yarn":
        return _yarn(rope, head_dim)
    if kind == "llama3":
        return _llama3(rope, head_dim), 1.0
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

    def __init__(self, rope: RopeConfig, head_dim: int, max_len: int, dtype: torch.dtype) -> None:
        self.rope, self.head_dim, self.dtype = rope, head_dim, dtype
        inv, attn = inv_freq_and_attention_factor(rope, head_dim)
        cos, sin = cos_sin(inv, attn, torch.arange(max_len))
        self.cos, self.sin = cos.to(dtype), sin.to(dtype)

    def lookup(
        self, positions: torch.Tensor, seq_lens: list[tuple[int, int, int]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for `positions`; `seq_lens` gives (start, count, length) per sequence chunk.

        For dynamic NTK each chunk uses its own sequence length, as transformers does for a
        single sequence, so that cached keys match a plain forward at the time they were written.
        """
        cos, sin = self.cos[positions], self.sin[positions]
        if self.rope.rope_type != "dynamic" or not seq_lens:
            return cos, sin
        for start, count, length in seq_lens:
            if length > self.rope.max_position_embeddings:
                inv, attn = inv_freq_and_attention_factor(self.rope, self.head_dim, length)
                c, s = cos_sin(inv, attn, positions[start : start + count])
                cos[start : start + count], sin[start : start + count] = c.to(self.dtype), s.to(self.dtype)
        return cos, sin
