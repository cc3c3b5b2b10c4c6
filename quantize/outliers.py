"""Function-preserving outliers: a model on which 4-bit rounding is costly, as on real LLMs.

For each decoder layer and each chosen hidden channel ``c``, a factor ``m`` moves between the
RMSNorm weight and column ``c`` of every linear that norm feeds (q/k/v, gate/up). The float model
computes the same logits; its quantization problem becomes that of real LLMs, whose outlier
channels stretch their groups' integer grids. `python -m benchmarks.outlier_standin` writes such
a copy of a model (its docstring says why and which magnitudes).
"""

from __future__ import annotations

from typing import Any

import torch

NORM_FEEDS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}


def pick_channels(hidden: int, count: int, seed: int) -> list[int]:
    """``count`` distinct hidden channels, reproducible from ``seed``."""
    if not 0 < count <= hidden:
        raise ValueError(f"--channels must be in 1..{hidden} (the model's hidden size), got {count}")
    gen = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(hidden, generator=gen)[:count].tolist())


def inject_outliers(model: Any, channels: list[int], magnitude: float, kind: str = "weight") -> None:
    """Move a factor ``magnitude`` between ``channels`` of every layer's norms and the fed columns.

    ``kind="weight"``: norm / m, fed columns * m (the columns become their groups' outliers).
    ``kind="activation"``: norm * m, fed columns / m (the activations become outliers).

    Works on Llama-family layouts (``model.model.layers[i]`` with the two RMSNorms and the
    linears named in ``NORM_FEEDS``); raises naming what is missing otherwise.
    """
    if magnitude <= 0:
        raise ValueError(f"--magnitude must be positive, got {magnitude}")
    if kind not in ("weight", "activation"):
        raise ValueError(f"--kind must be 'weight' or 'activation', got {kind!r}")
    to_norm = magnitude if kind == "activation" else 1.0 / magnitude
    idx = torch.tensor(channels)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for norm_name, fed in NORM_FEEDS.items():
                norm = _get(layer, norm_name, i)
                norm.weight[idx] *= to_norm
                for name in fed:
                    _get(layer, name, i).weight[:, idx] /= to_norm


def _get(layer: Any, dotted: str, index: int) -> Any:
    obj = layer
    for part in dotted.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"layer {index} has no {dotted}: only Llama-family layouts are supported")
        obj = getattr(obj, part)
    return obj
