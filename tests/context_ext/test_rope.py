"""serve.rope, the one RoPE implementation, in float64 against transformers' references (ROPE_INIT_FUNCTIONS):
what context_ext checks the configs it writes with."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from serve import rope

N_CONFIGS = 150


def _random_params(rng: random.Random, kind: str) -> tuple[dict[str, Any], int, int]:
    head_dim = rng.choice([16, 32, 64, 80, 96, 128, 256])
    params: dict[str, Any] = {
        "rope_type": kind,
        "rope_theta": 10 ** rng.uniform(3, 7),
        "factor": rng.choice([rng.uniform(1.0, 64.0), float(rng.choice([2, 4, 8, 16, 32]))]),
    }
    if rng.random() < 0.3:
        params["partial_rotary_factor"] = rng.choice([0.25, 0.5, 0.75])
    original = rng.choice([128, 256, 512, 2048, 4096, 8192, 32768])
    max_pos = int(original * params["factor"]) if kind != "dynamic" else original
    if kind == "yarn":
        params["original_max_position_embeddings"] = original
        for key, draw in (
            ("beta_fast", lambda: rng.choice([rng.uniform(4, 64), 32])),
            ("beta_slow", lambda: rng.choice([rng.uniform(0.5, 2), 1])),
            ("mscale", lambda: rng.uniform(0.5, 1.5)),
            ("mscale_all_dim", lambda: rng.choice([0.0, rng.uniform(0.5, 1.5)])),
            ("truncate", lambda: rng.random() < 0.5),
        ):
            if rng.random() < 0.4:
                params[key] = draw()
        if rng.random() < 0.2:
            params["attention_factor"] = rng.uniform(0.5, 2.0)
        if rng.random() < 0.1:
            params["factor"] = None  # DeepSeek style: factor inferred from max/original
            max_pos = original * rng.choice([4, 16])
    return params, head_dim, max_pos


def _reference(
    params: dict[str, Any], head_dim: int, max_pos: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    cfg = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=dict(params),
        vocab_size=16,
        num_hidden_layers=1,
        intermediate_size=16,
    )
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu", seq_len=seq_len)


def _close(ours: tuple[torch.Tensor, float], ref: tuple[torch.Tensor, float]) -> None:
    inv, scale = ours
    ref_inv, ref_scale = ref
    assert inv.shape == ref_inv.shape
    torch.testing.assert_close(inv, ref_inv.to(torch.float64), atol=1e-6, rtol=1e-6)
    assert math.isclose(scale, float(ref_scale), rel_tol=1e-6, abs_tol=1e-6)


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn"])
def test_matches_transformers_on_random_configs(kind: str) -> None:
    rng = random.Random(kind)
    for _ in range(N_CONFIGS):
        params, head_dim, max_pos = _random_params(rng, kind)
        seq_len = rng.choice([None, max_pos // 2, max_pos, max_pos * 3]) if kind == "dynamic" else None
        ours = rope.from_rope_parameters(params, head_dim, max_pos, seq_len)
        _close(ours, _reference(params, head_dim, max_pos, seq_len))


def test_yarn_function_defaults_are_the_papers() -> None:
    """Called directly, yarn() with no options is beta 32/1, truncate, 0.1 ln s + 1."""
    rng = random.Random(1)
    for _ in range(50):
        dim, theta = rng.choice([32, 64, 128]), 10 ** rng.uniform(3, 6)
        factor, original = rng.uniform(1.5, 32), rng.choice([256, 4096])
        params = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": factor,
            "original_max_position_embeddings": original,
        }
        ours = rope.yarn(dim, theta, factor, original)
        _close(ours, _reference(params, dim, int(original * factor)))
        assert ours[1] == pytest.approx(0.1 * math.log(factor) + 1)


def test_static_ntk_equals_dynamic_at_the_matching_length() -> None:
    """Static NTK with alpha is transformers' dynamic NTK at the length where alpha is reached.

    Dynamic NTK uses alpha = s*L/L0 - (s-1); with s = alpha and L = L0*(2*alpha-1)/alpha the
    two coincide, which checks the static base formula against an independent reference.
    """
    rng = random.Random(2)
    for _ in range(50):
        dim, theta, alpha = rng.choice([32, 64, 128]), 10 ** rng.uniform(3, 6), rng.uniform(1.5, 16)
        original = rng.choice([256, 2048])
        seq_len = original * (2 * alpha - 1) / alpha
        params = {"rope_type": "dynamic", "rope_theta": theta, "factor": alpha}
        _close(rope.ntk_inv_freq(dim, theta, alpha), _reference(params, dim, original, seq_len))


def test_static_ntk_interpolates_lowest_frequency_by_factor() -> None:
    dim, theta, factor = 64, 10000.0, 4.0
    base = rope.default_inv_freq(dim, theta)
    ntk, _ = rope.ntk_inv_freq(dim, theta, factor)
    assert float(ntk[0]) == pytest.approx(float(base[0]))
    assert float(ntk[-1]) == pytest.approx(float(base[-1]) / factor, rel=1e-9)


def test_yarn_interpolates_low_frequencies_and_keeps_high_ones() -> None:
    dim, theta, factor, original = 64, 10000.0, 8.0, 2048
    base = rope.default_inv_freq(dim, theta)
    inv = rope.yarn_inv_freq(dim, theta, factor, original)
    low, high = rope.yarn_correction_range(dim, theta, original, 32, 1, True)
    assert torch.allclose(inv[: int(low)], base[: int(low)])
    assert torch.allclose(inv[int(high) :], base[int(high) :] / factor)
    # beta_slow = 1: the first fully interpolated pair completes at most ~one turn in `original`
    assert float(2 * math.pi / base[int(high)]) > original / 2


def test_attention_factor_precedence() -> None:
    assert rope.yarn_attention_factor(4.0, attention_factor=0.7) == 0.7
    assert rope.yarn_attention_factor(4.0, mscale=1.0, mscale_all_dim=1.0) == pytest.approx(1.0)
    assert rope.yarn_attention_factor(4.0, mscale=0.707, mscale_all_dim=0.0) == pytest.approx(0.1 * math.log(4) + 1)
    assert rope.yarn_attention_factor(1.0) == 1.0


def test_unsupported_rope_type_is_named() -> None:
    with pytest.raises(ValueError, match="longrope"):
        rope.from_rope_parameters({"rope_type": "longrope"}, 64, 4096)
