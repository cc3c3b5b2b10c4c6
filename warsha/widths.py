"""A model's linear widths, known at planning time, before any weight is loaded.

Why: a stage that can only handle some widths (a quantizer's group size must divide every
quantized ``in_features``) should say so when the recipe is planned, not forty minutes later
when it reaches that stage. The widths come from what the recipe already names: a base
directory's ``config.json``, an import source's GGUF header, a bootstrap's parameters, and each
stage that changes them (a draft) says how (``StageDef.widths``); every other stage passes its
input's widths through. Nothing heavy is imported.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Widths:
    """What decides every decoder linear's shape, and where it was read from."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    source: str

    def with_layers(self, num_layers: int, source: str) -> "Widths":
        """The same widths with a different depth (a draft that keeps some layers)."""
        return replace(self, num_layers=num_layers, source=source)


def from_sizes(model_type: str, sizes: Any, source: str) -> Widths:
    """From parameters named like a bootstrap's or a draft's (``hidden_size``,
    ``intermediate_size``, ``num_heads``, ``num_kv_heads``, ``num_layers``; head size
    ``hidden_size // num_heads``)."""
    return Widths(
        model_type,
        sizes.hidden_size,
        sizes.intermediate_size,
        sizes.num_heads,
        sizes.num_kv_heads,
        sizes.hidden_size // sizes.num_heads,
        sizes.num_layers,
        source,
    )


def from_config(cfg: dict[str, Any], source: str) -> Widths | None:
    """From an HF ``config.json`` mapping (``text_config`` when nested); None if incomplete."""
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {"model_type": cfg.get("model_type"), **cfg["text_config"]}
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        return Widths(
            model_type=str(cfg.get("model_type")),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            num_layers=int(cfg["num_hidden_layers"]),
            source=source,
        )
    except (KeyError, TypeError, ValueError):
        return None


def from_model_dir(path: Path) -> Widths | None:
    """From a model directory's ``config.json``; None when it has none (yet) or it is unreadable."""
    cfg = Path(path) / "config.json"
    try:
        return from_config(json.loads(cfg.read_text()), str(cfg))
    except (OSError, ValueError):
        return None


def from_gguf(files: Sequence[Path], model_type: str, arch: str, label: str) -> Widths | None:
    """From a GGUF header's ``<arch>.*`` keys (``general.architecture`` is ``arch``)."""
    from warsha.model_import.gguf_header import GGUFError, read_header

    keys = {
        "hidden": f"{arch}.embedding_length",
        "ffn": f"{arch}.feed_forward_length",
        "layers": f"{arch}.block_count",
        "heads": f"{arch}.attention.head_count",
        "kv": f"{arch}.attention.head_count_kv",
        "head_dim": f"{arch}.attention.key_length",
    }
    try:
        head = read_header(files, tuple(keys.values()))
    except (GGUFError, OSError):
        return None
    v = {name: head.get(key) for name, key in keys.items()}
    if any(v[k] is None for k in ("hidden", "ffn", "layers", "heads")):
        return None
    heads = int(v["heads"])
    return Widths(
        model_type=model_type,
        hidden_size=int(v["hidden"]),
        intermediate_size=int(v["ffn"]),
        num_heads=heads,
        num_kv_heads=int(v["kv"] or heads),
        head_dim=int(v["head_dim"] or int(v["hidden"]) // heads),
        num_layers=int(v["layers"]),
        source=f"{label} (GGUF header)",
    )
