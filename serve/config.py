"""Model configuration read from an HF `config.json`, without transformers.

The families served (`serve.arch`: Llama, Mistral, Qwen2, Qwen3, Gemma 3 text) share one
forward; this module turns config.json into the numbers and switches that forward reads, per
layer where they differ (sliding window, RoPE). Anything else is refused at load with the list
of what is supported, rather than served wrongly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve.arch import SUPPORTED_MODEL_TYPES, Family, activation_name, check_unsupported, family_for, layer_windows
from serve.rope import RopeConfig, rope_configs_by_layer_type

__all__ = ["SUPPORTED_MODEL_TYPES", "GPTQConfig", "ModelConfig"]


@dataclass(frozen=True)
class GPTQConfig:
    """The `quantization_config` of a 4-bit GPTQ checkpoint, or of an AWQ-GEMM one (`layout`
    "awq": its words are repacked into GPTQ v2 at load, `serve.awq`)."""

    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    checkpoint_format: str
    layout: str = "gptq"

    @classmethod
    def from_dict(cls, qc: dict[str, Any], path: Path) -> "GPTQConfig":
        """Validate and read `qc`; errors name the file and the offending key."""
        method = qc.get("quant_method")
        if method not in ("gptq", "awq"):
            raise ValueError(
                f"{path}: quantization_config.quant_method={method!r} is not supported; 'gptq' and 'awq' are"
            )
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        if bits != 4:
            raise ValueError(f"{path}: quantization_config.bits={bits} is not supported; only 4-bit weights are")
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"{path}: quantization_config.version={version!r}; only AWQ's 'gemm' layout is served")
            group = int(qc.get("group_size", qc.get("q_group_size", 128)))
            return cls(bits, group, not bool(qc.get("zero_point", True)), False, "gptq_v2", "awq")
        fmt = qc.get("checkpoint_format", "gptq") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"{path}: quantization_config.checkpoint_format={fmt!r}; supported: 'gptq', 'gptq_v2'")
        return cls(
            bits, int(qc.get("group_size", 128)), bool(qc.get("sym", True)), bool(qc.get("desc_act", False)), fmt
        )


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the forward needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope: RopeConfig
    quant: GPTQConfig | None
    sliding_window: int | None  # the largest window of any layer; None when every layer is full
    family: Family
    layer_windows: tuple[int | None, ...]  # per layer: its sliding window, None for full attention
    rope_local: RopeConfig  # RoPE of sliding layers (the same as `rope` except in Gemma 3)
    activation: str
    attention_scale: float
    final_logit_softcapping: float | None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Read `model_dir/config.json`."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found; model_dir must be an HF-format model directory")
        return cls.from_dict(json.loads(path.read_text()), path)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], path: Path | str = "config.json") -> "ModelConfig":
        """Build from a parsed config.json; `path` is only used in error messages."""
        family = family_for(cfg, path)
        check_unsupported(cfg, path)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        num_layers = int(cfg["num_hidden_layers"])
        qc = cfg.get("quantization_config")
        windows = layer_windows(cfg, family, num_layers, path)
        ropes = rope_configs_by_layer_type(cfg, family.local_rope_base)
        scalar = cfg.get("query_pre_attn_scalar") if family.scale_from_query_pre_attn_scalar else None
        softcap = cfg.get("final_logit_softcapping")
        return cls(
            model_type=family.name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family.qkv_bias)),
            rope=ropes["full_attention"],
            quant=GPTQConfig.from_dict(qc, Path(path)) if qc else None,
            sliding_window=max((w for w in windows if w), default=None),
            family=family,
            layer_windows=windows,
            rope_local=ropes["sliding_attention"],
            activation=activation_name(cfg, family, path),
            attention_scale=float(scalar if scalar is not None else head_dim) ** -0.5,
            final_logit_softcapping=float(softcap) if softcap else None,
        )

    @property
    def max_model_len(self) -> int:
        """Longest sequence served exactly.

        Dynamic NTK exists to run past max_position_embeddings, up to `factor` times it. Sliding
        windows do not cap it: sliding layers attend to their window, as in the reference.
        """
        length = self.max_position_embeddings
        if self.rope.rope_type == "dynamic":
            length = int(length * self.rope.factor)
        return length
