"""Model configuration read from an HF `config.json`, without transformers.

Only the Llama family is served: Llama, Mistral and Qwen2 share one forward (GQA, RoPE,
RMSNorm, SwiGLU); they differ in biases on q/k/v (Qwen2) and in naming. Anything else is
refused at load with the list of what is supported, rather than served wrongly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve.rope import RopeConfig, rope_config_from_hf

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class GPTQConfig:
    """The `quantization_config` of a GPTQ checkpoint (4-bit only)."""

    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    checkpoint_format: str

    @classmethod
    def from_dict(cls, qc: dict[str, Any], path: Path) -> "GPTQConfig":
        """Validate and read `qc`; errors name the file and the offending key."""
        method = qc.get("quant_method")
        if method != "gptq":
            raise ValueError(f"{path}: quantization_config.quant_method={method!r} is not supported; only 'gptq' is")
        bits = int(qc.get("bits", 4))
        if bits != 4:
            raise ValueError(f"{path}: quantization_config.bits={bits} is not supported; only 4-bit GPTQ is")
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
    sliding_window: int | None

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
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            arch = cfg.get("architectures")
            raise ValueError(
                f"{path}: model_type={model_type!r} (architectures={arch}) is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        qc = cfg.get("quantization_config")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            rope=rope_config_from_hf(cfg),
            quant=GPTQConfig.from_dict(qc, Path(path)) if qc else None,
            sliding_window=int(window) if window else None,
        )

    @property
    def max_model_len(self) -> int:
        """Longest sequence served exactly.

        Dynamic NTK exists to run past max_position_embeddings, up to `factor` times it; a
        sliding window (not implemented as such) caps the length where full attention is exact.
        """
        length = self.max_position_embeddings
        if self.rope.rope_type == "dynamic":
            length = int(length * self.rope.factor)
        if self.sliding_window:
            length = min(length, self.sliding_window)
        return length
