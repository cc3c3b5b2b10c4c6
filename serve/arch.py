"""Model families as data: what differs between Llama, Mistral, Qwen2, Qwen3 and Gemma 3.

All five are decoder-only transformers with GQA, RoPE, RMSNorm and a gated MLP; they differ in a
handful of switches (as AutoAWQ and vLLM keep them): how RMSNorm applies its weight (`w` or
`1 + w`), whether embeddings are scaled by sqrt(hidden), per-head q/k norms, the MLP activation,
q/k/v biases, norms after attention and after the MLP ("sandwich" norms), the attention scale,
and which layers attend through a sliding window with which RoPE base. One forward
(`serve.model`) reads these switches; a family is one `Family` value here, not a copy of the
forward. Anything not listed is refused at load with the list, rather than served wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FULL, SLIDING = "full_attention", "sliding_attention"
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class Family:
    """The switches of one model family (read with the config.json that names it)."""

    name: str
    norm_plus_one: bool = False  # RMSNorm multiplies by (1 + w) in float32 (Gemma) instead of w
    embed_scale: bool = False  # embeddings * sqrt(hidden_size), rounded to the model dtype (Gemma)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms on the attention and MLP outputs too (Gemma 3's four norms)
    qkv_bias: bool = False  # default for `attention_bias` when config.json does not say
    activation: str = "silu"  # default for `hidden_act` / `hidden_activation`
    scale_from_query_pre_attn_scalar: bool = False  # attention scale query_pre_attn_scalar**-0.5
    sliding_from_max_window_layers: bool = False  # Qwen: layers >= max_window_layers slide when enabled
    all_layers_slide: bool = False  # Mistral: `sliding_window` set means every layer slides
    local_rope_base: bool = False  # sliding layers have their own RoPE base (Gemma 3)
    requires_bos: bool = False  # the model degrades badly without its BOS token (Gemma)


FAMILIES: dict[str, Family] = {
    "llama": Family("llama"),
    "mistral": Family("mistral", all_layers_slide=True),
    "qwen2": Family("qwen2", qkv_bias=True, sliding_from_max_window_layers=True),
    "qwen3": Family("qwen3", qk_norm=True, sliding_from_max_window_layers=True),
    "gemma3_text": Family(
        "gemma3_text",
        norm_plus_one=True,
        embed_scale=True,
        qk_norm=True,
        sandwich_norms=True,
        activation="gelu_pytorch_tanh",
        scale_from_query_pre_attn_scalar=True,
        local_rope_base=True,
        requires_bos=True,
    ),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family_for(cfg: dict[str, Any], path: object) -> Family:
    """The family a parsed config.json names; unknown families are refused with the list."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        arch = cfg.get("architectures")
        hint = (
            " (a Gemma 3 checkpoint with vision: serve its text model, `gemma3_text`)" if model_type == "gemma3" else ""
        )
        raise ValueError(
            f"{path}: model_type={model_type!r} (architectures={arch}) is not supported{hint}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return FAMILIES[model_type]


def layer_windows(cfg: dict[str, Any], family: Family, num_layers: int, path: object) -> tuple[int | None, ...]:
    """The sliding window of every layer (None for full attention), as transformers decides it.

    `layer_types` wins when present (Gemma 3, Qwen 2/3 written by transformers 5); otherwise
    Qwen slides layers >= `max_window_layers` when `use_sliding_window`, Mistral slides every
    layer when `sliding_window` is set, and Gemma 3 slides all but every sixth layer.
    """
    window = cfg.get("sliding_window")
    if family.sliding_from_max_window_layers and not cfg.get("use_sliding_window", False):
        window = None
    types = cfg.get("layer_types")
    if types is None:
        if family.all_layers_slide:
            types = [SLIDING if window else FULL] * num_layers
        elif family.sliding_from_max_window_layers:
            first = int(cfg.get("max_window_layers", num_layers))
            types = [SLIDING if window is not None and i >= first else FULL for i in range(num_layers)]
        elif family.local_rope_base:
            pattern = int(cfg.get("sliding_window_pattern", 6))
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
        else:
            types = [FULL] * num_layers
    if len(types) != num_layers or any(t not in (FULL, SLIDING) for t in types):
        raise ValueError(
            f"{path}: layer_types must list {num_layers} entries of {FULL!r} or {SLIDING!r}, got {types!r}"
        )
    if SLIDING in types and not window:
        if family.sliding_from_max_window_layers:
            return (None,) * num_layers  # transformers drops the window when use_sliding_window is off
        raise ValueError(f"{path}: layer_types has {SLIDING!r} layers but sliding_window is {window!r}; set it")
    return tuple(int(window) if t == SLIDING else None for t in types)


def activation_name(cfg: dict[str, Any], family: Family, path: object) -> str:
    """The MLP activation; only the two the families use are accepted."""
    name = cfg.get("hidden_activation") or cfg.get("hidden_act") or family.activation
    if name == "gelu_tanh":
        name = "gelu_pytorch_tanh"
    if name not in ACTIVATIONS:
        raise ValueError(f"{path}: hidden_act={name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return name


def check_unsupported(cfg: dict[str, Any], path: object) -> None:
    """Refuse switches the forward does not implement rather than ignore them."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError(f"{path}: attn_logit_softcapping is not supported (Gemma 2 style); set it to null")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{path}: use_bidirectional_attention=true (an encoder) is not supported for generation")
