"""Supported architectures, described as data rather than code.

Why data: AWQ needs to know which normalisation or linear layer *feeds* which linears (a
per-channel scale divided out of the feeder is multiplied into the fed linears, which leaves
the float model unchanged), and GPTQ needs the order in which a decoder layer's linears see
their inputs. Both facts are the same for every Llama-like model, so one table covers Llama,
Mistral, Qwen2 and Qwen3 (whose per-head q/k norms sit after q_proj/k_proj and so leave the
input-norm -> q/k/v scaling exact), and a new family is a new entry, not a new code path.
Gemma 3 differs in its norms: four per layer, each multiplying by (1 + w); the one before the
MLP is `pre_feedforward_layernorm` (its `post_attention_layernorm` normalises the attention
output and feeds no linear), and scaling a (1 + w) norm by 1/s means w' = (1 + w) / s - 1
(`prev_kind="norm_plus_one"`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ScaleGroup:
    """One AWQ scaling group inside a decoder layer (module names relative to the layer).

    ``prev`` is the module whose output channels feed every linear in ``linears``; ``inspect``
    is the module whose output measures the error of a trial scale (the attention block for
    q/k/v, the MLP for gate/up, the fed linear itself otherwise). ``needs_same_width`` marks
    groups that only exist when ``prev``'s output width equals the fed linears' input width
    (v -> o is impossible under grouped-query attention).
    """

    prev: str
    prev_kind: str  # "norm", "norm_plus_one" (Gemma's (1 + w) RMSNorm) or "linear"
    linears: tuple[str, ...]
    inspect: str
    needs_same_width: bool = False


@dataclass(frozen=True)
class ArchSpec:
    """How to walk one architecture family."""

    name: str
    model_types: tuple[str, ...]
    layers: str
    attention: str
    sequential: tuple[tuple[str, ...], ...]
    scale_groups: tuple[ScaleGroup, ...]
    # AWQ does not clip these: their error is amplified by softmax(QK^T) (llm-awq skips them too)
    no_clip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")

    @property
    def linears(self) -> tuple[str, ...]:
        """Every quantized linear of a decoder layer, in forward order."""
        return tuple(name for step in self.sequential for name in step)


_LLAMA_LIKE_GROUPS = (
    ScaleGroup("input_layernorm", "norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    ScaleGroup("self_attn.v_proj", "linear", ("self_attn.o_proj",), "self_attn.o_proj", needs_same_width=True),
    ScaleGroup("post_attention_layernorm", "norm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    ScaleGroup("mlp.up_proj", "linear", ("mlp.down_proj",), "mlp.down_proj"),
)
_LLAMA_LIKE_ORDER = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)

_GEMMA3_GROUPS = (
    ScaleGroup(
        "input_layernorm", "norm_plus_one", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"
    ),
    ScaleGroup("self_attn.v_proj", "linear", ("self_attn.o_proj",), "self_attn.o_proj", needs_same_width=True),
    ScaleGroup("pre_feedforward_layernorm", "norm_plus_one", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    ScaleGroup("mlp.up_proj", "linear", ("mlp.down_proj",), "mlp.down_proj"),
)

ARCHITECTURES: tuple[ArchSpec, ...] = (
    ArchSpec("llama", ("llama",), "model.layers", "self_attn", _LLAMA_LIKE_ORDER, _LLAMA_LIKE_GROUPS),
    ArchSpec("mistral", ("mistral",), "model.layers", "self_attn", _LLAMA_LIKE_ORDER, _LLAMA_LIKE_GROUPS),
    ArchSpec("qwen2", ("qwen2",), "model.layers", "self_attn", _LLAMA_LIKE_ORDER, _LLAMA_LIKE_GROUPS),
    ArchSpec("qwen3", ("qwen3",), "model.layers", "self_attn", _LLAMA_LIKE_ORDER, _LLAMA_LIKE_GROUPS),
    ArchSpec("gemma3", ("gemma3_text",), "model.layers", "self_attn", _LLAMA_LIKE_ORDER, _GEMMA3_GROUPS),
)


def supported_model_types() -> list[str]:
    """Every ``model_type`` some entry covers."""
    return sorted(t for spec in ARCHITECTURES for t in spec.model_types)


def arch_for(model_type: str) -> ArchSpec:
    """The spec for a ``config.json`` ``model_type``; a clear error for anything else."""
    for spec in ARCHITECTURES:
        if model_type in spec.model_types:
            return spec
    raise ValueError(
        f"quantize: architecture {model_type!r} is not supported; supported model_type values:"
        f" {', '.join(supported_model_types())}. Describe it in quantize/arch.py to add it."
    )


def get_module(root: Any, dotted: str) -> Any:
    """``root.a.b.c`` for ``"a.b.c"`` (ModuleList indices included)."""
    obj = root
    for part in dotted.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def decoder_layers(model: Any, spec: ArchSpec) -> Any:
    """The model's ModuleList of decoder layers."""
    return get_module(model, spec.layers)
