"""Which KV block group each layer's cache lives in (vLLM's hybrid allocator, torch-free).

Layers attend either to everything (full attention) or to a sliding window. A full layer must
keep every block of a sequence; a sliding layer needs only the blocks its window can still see.
So layers are split into groups of equal size, each group holding layers of one kind, and each
sequence has one block table per group. All blocks come from one pool and cost the same
(`layers_per_block` layers of K/V), so a block freed by a sliding group can serve a full group
next. A Gemma 3 with 15 sliding and 3 full layers gets 6 groups of 3 layers: one full group that
grows with the sequence and five sliding groups that each hold about window / block_size blocks.
A model whose layers are all of one kind has a single group (today's one table per sequence).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    """Layer -> (group, slot within the group's blocks); group -> window (None: full attention)."""

    group_windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        """Block tables per sequence."""
        return len(self.group_windows)

    @property
    def layers_per_block(self) -> int:
        """Layers whose K/V one block holds (the first dimension of the cache tensors)."""
        return max(self.layer_slot) + 1


def _kind_order(window: int | None) -> tuple[int, int]:
    """Full attention first (group 0 then holds a sequence's whole history), then by window."""
    return (0, 0) if window is None else (1, window)


def layout_for(layer_windows: tuple[int | None, ...]) -> KVLayout:
    """Group a model's own layers: kinds split into groups of gcd(layers per kind) layers."""
    by_kind: dict[int | None, list[int]] = defaultdict(list)
    for i, w in enumerate(layer_windows):
        by_kind[w].append(i)
    size = math.gcd(*(len(v) for v in by_kind.values()))
    windows: list[int | None] = []
    group = [0] * len(layer_windows)
    slot = [0] * len(layer_windows)
    for kind in sorted(by_kind, key=_kind_order):
        layers = by_kind[kind]
        for start in range(0, len(layers), size):
            for j, layer in enumerate(layers[start : start + size]):
                group[layer], slot[layer] = len(windows), j
            windows.append(kind)
    return KVLayout(tuple(windows), tuple(group), tuple(slot))


def bind_to(layer_windows: tuple[int | None, ...], target: KVLayout, name: str = "draft") -> KVLayout:
    """Place another model's layers (a draft's) on `target`'s groups, sharing its block tables.

    A layer may use a group whose blocks cover at least what it reads: a full layer needs a full
    group; a sliding layer a full group or one with a window at least its own. Layers spread over
    the fitting groups so that the draft's per-block tensor stays small.
    """
    used = [0] * target.num_groups
    group, slot = [], []
    for i, w in enumerate(layer_windows):
        windows = target.group_windows
        fits = [g for g, gw in enumerate(windows) if gw == w] or [
            g for g, gw in enumerate(windows) if gw is None or (w is not None and gw >= w)
        ]
        if not fits:
            raise ValueError(
                f"{name} layer {i} (window {w}) has no KV group to live in: the target keeps only sliding "
                f"windows {sorted({x for x in target.group_windows if x})}; use a draft whose windows fit"
            )
        g = min(fits, key=lambda x: used[x])
        group.append(g)
        slot.append(used[g])
        used[g] += 1
    return KVLayout(target.group_windows, tuple(group), tuple(slot))
