"""The comparison table (markdown) and plot (PNG) written beside the extended model."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _passkey_cell(cell: dict[str, Any]) -> str:
    low, high = cell["ci95"]
    return f"{100 * cell['accuracy']:.0f}% [{100 * low:.0f}-{100 * high:.0f}] (n={cell['trials']})"


def table(
    results: dict[str, dict[str, Any]],
    lengths: Sequence[int],
    short: dict[str, dict[str, float]],
    original: int,
    short_other: dict[str, dict[str, float]] | None = None,
) -> str:
    """One markdown table: passkey accuracy with its 95% interval, perplexity, short-context ratios
    (in the fine-tune's language and, when given, in the corpus's other language)."""
    mult = [f"{n / original:g}x" for n in lengths]
    short_keys = sorted({k for v in short.values() for k in v}, key=int)
    other = short_other or {}
    other_keys = sorted({k for v in other.values() for k in v}, key=int)
    head = (
        ["method"]
        + [f"passkey {m} ({n})" for m, n in zip(mult, lengths)]
        + [f"ppl {m}" for m in mult]
        + [f"short ppl / none @{k}" for k in short_keys]
        + [f"other language short ppl / none @{k}" for k in other_keys]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        row = [name]
        row += [_passkey_cell(r["passkey"][str(n)]) for n in lengths]
        row += [f"{r['perplexity'][str(n)]:.2f}" for n in lengths]
        row += [f"{short[name][k]:.3f}" for k in short_keys]
        row += [f"{other[name][k]:.3f}" if name in other else "-" for k in other_keys]
        lines.append("| " + " | ".join(row) + " |")
    note = (
        "\nPasskey: exact greedy match of a 5-digit key at depths "
        "10-90%, 95% Wilson interval in brackets; ppl: sliding-window perplexity on held-out "
        "text (window = the length, stride half of it); short ppl / none: perplexity at or "
        "below the original length divided by the unscaled model's.\n"
    )
    return "\n".join(lines) + "\n" + note


def plot(results: dict[str, dict[str, Any]], lengths: Sequence[int], original: int, path: Path) -> None:
    """Perplexity and passkey accuracy against context length, a line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ppl, ax_key) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, r in results.items():
        ppl = [r["perplexity"][str(n)] for n in lengths]
        acc = [r["passkey"][str(n)]["accuracy"] for n in lengths]
        cells = [r["passkey"][str(n)] for n in lengths]
        err = [[a - c["ci95"][0] for a, c in zip(acc, cells)], [c["ci95"][1] - a for a, c in zip(acc, cells)]]
        ax_ppl.plot(lengths, ppl, marker="o", label=name)
        ax_key.errorbar(lengths, acc, yerr=err, marker="o", capsize=3, label=name)
    for ax in (ax_ppl, ax_key):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(lengths), [f"{n}\n({n / original:g}x)" for n in lengths])
        ax.axvline(original, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("context length (tokens)")
        ax.grid(alpha=0.3)
    ax_ppl.set_yscale("log")
    ax_ppl.set_ylabel("perplexity (held-out, sliding window)")
    ax_key.set_ylabel("passkey accuracy (95% CI)")
    ax_key.set_ylim(-0.03, 1.03)
    ax_key.legend(fontsize=8, loc="lower left")
    fig.suptitle("Context extension: perplexity and passkey retrieval by method")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
