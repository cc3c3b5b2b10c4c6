"""Which linears a group size and packing can hold, checked from widths alone (no torch).

Shared by planning (``check_widths``: the recipe fails before any stage runs, from the
widths of ``config.json`` or a GGUF header) and by the stage itself (``plan_layers``, on the
loaded modules). A bad shape repeats in every layer, so problems are reported once per
pattern ("q/k/v/o/gate/up_proj in all 30 layers: in_features 576 is not a multiple of
group_size 128"), not once per linear.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from quantize.arch import ArchSpec

AUTO_GROUP_SIZES = (128, 64, 32)


def layout_problem(in_f: int, out_f: int, bits: int, group_size: int, fmt: str) -> str | None:
    """Why a linear of this shape cannot be stored in ``fmt`` with this grid, or None."""
    if in_f % group_size:
        return f"in_features {in_f} is not a multiple of group_size {group_size}"
    if fmt == "gptq" and ((in_f * bits) % 32 or (out_f * bits) % 32):
        return (
            f"GPTQ packing of {bits}-bit values needs in/out features giving whole int32 words (in {in_f}, out {out_f})"
        )
    if fmt == "awq" and out_f % 8:
        return f"AWQ packing needs out_features divisible by 8, got {out_f}"
    return None


def linear_shapes(arch: ArchSpec, widths: Any) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each quantized linear of one decoder layer."""
    h, i = widths.hidden_size, widths.intermediate_size
    q, kv = widths.num_heads * widths.head_dim, widths.num_kv_heads * widths.head_dim
    known = {
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, i),
        "mlp.up_proj": (h, i),
        "mlp.down_proj": (i, h),
    }
    return {name: known[name] for name in arch.linears}


def short_names(names: list[str]) -> str:
    """``self_attn.q_proj, self_attn.k_proj, mlp.up_proj`` -> ``q/k/up_proj``."""
    leaves = [n.rpartition(".")[2] for n in names]
    if len(leaves) > 1 and all(leaf.endswith("_proj") for leaf in leaves):
        return "/".join(leaf.removesuffix("_proj") for leaf in leaves[:-1]) + "/" + leaves[-1]
    return ", ".join(leaves)


def layer_span(layers: Iterable[int], num_layers: int) -> str:
    """``all 30 layers``, ``layer 3`` or ``layers 0-3, 7``."""
    idx = sorted(set(layers))
    if len(idx) == num_layers:
        return f"all {num_layers} layers"
    runs: list[str] = []
    start = prev = idx[0]
    for k in idx[1:] + [None]:
        if k is not None and k == prev + 1:
            prev = k
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if k is not None:
            start = prev = k
    return ("layer " if len(idx) == 1 else "layers ") + ", ".join(runs)


def summarize(problems: dict[tuple[int, str], str], num_layers: int) -> list[str]:
    """One line per distinct problem: the linears and layers it hits, in forward order."""
    by_problem: dict[str, tuple[list[str], set[int]]] = {}
    for (layer, name), text in problems.items():
        names, layers = by_problem.setdefault(text, ([], set()))
        if name not in names:
            names.append(name)
        layers.add(layer)
    return [
        f"{short_names(names)} in {layer_span(layers, num_layers)}: {text}"
        for text, (names, layers) in by_problem.items()
    ]


def shape_problems(
    shapes: dict[str, tuple[int, int]], num_layers: int, bits: int, group_size: int, fmt: str
) -> dict[tuple[int, str], str]:
    """Every (layer, linear) whose shape the grid cannot hold, with why (same widths per layer)."""
    out = {}
    for name, (in_f, out_f) in shapes.items():
        if problem := layout_problem(in_f, out_f, bits, group_size, fmt):
            out.update({(layer, name): problem for layer in range(num_layers)})
    return out


def fitting_group_sizes(shapes: Iterable[tuple[int, int]], bits: int, fmt: str) -> list[int]:
    """Those of 128/64/32 (largest first) that every shape can take."""
    shapes = list(shapes)
    return [g for g in AUTO_GROUP_SIZES if not any(layout_problem(i, o, bits, g, fmt) for i, o in shapes)]


def advice(current: int | str, fits: list[int]) -> str:
    """What to set instead: the fitting sizes and ``auto``, or the fallback when none fits."""
    others = [str(g) for g in fits if g != current]
    if not others:
        return "no group size of 128/64/32 fits; set on_bad_group: fallback to keep these linears unquantized"
    if current != "auto":
        others.append("auto")
    listed = others[0] if len(others) == 1 else ", ".join(others[:-1]) + f" or {others[-1]}"
    return f"use group_size: {listed}"
