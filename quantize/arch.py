"""Supported architectures, described as data rather than code.

Why data: AWQ needs to know which normalisation or linear layer *feeds* which linears (a
per-channel scale divided out of the feeder is multiplied into the fed linears, which leaves
the float model unchanged), and GPTQ needs the order in which a decoder layer's linears see
their inputs. Both facts are the same for every Llama-like model, so one table covers Llama,
Mistral and Qwen2, and a new family is a new entry, not a new code path.
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
    prev_kind: str  # "norm" or "linear"
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

ARCHITECTURES: tuple[ArchSpec, ...] = (
    ArchSpec("llama", ("llama",), "model.layers", "self_attn", _LLAMA_LIKE_ORDER, _LLAMA_LIKE_GROUPS),
    ArchSpec("mistral", ("mistral",), "model.layers", "self_attn", _LLAMA_LIKE_ORDER, _LLAMA_LIKE_GROUPS),
    ArchSpec("qwen2", ("qwen2",), "model.layers", "self_attn", _LLAMA_LIKE_ORDER, _LLAMA_LIKE_GROUPS),
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
