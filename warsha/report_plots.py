"""The report's plots, one function per stage, each reading only that stage's manifest.

A plot function returns ``(title, png path or None, note)``; None with a note says which metric
was missing, so a gap in the report is visible rather than silent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

PlotResult = tuple[str, Path | None, str]


def _figure() -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6.4, 3.6), dpi=110)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _get(metrics: dict[str, Any], *keys: str) -> Any:
    node: Any = metrics
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def plot_bootstrap(m: dict[str, Any], out: Path, name: str) -> list[PlotResult]:
    """Held-out bits per character of the base model next to the unigram floor."""
    metrics = m.get("metrics", {})
    langs = [lang for lang in ("en", "ar") if _get(metrics, lang, "bits_per_char") is not None]
    title = "Base model: held-out bits per character vs a unigram model"
    if not langs:
        return [(title, None, "no bits_per_char in the manifest")]
    fig, ax = _figure()
    xs = range(len(langs))
    ax.bar([x - 0.2 for x in xs], [metrics[lang]["bits_per_char"] for lang in langs], 0.4, label="model")
    ax.bar([x + 0.2 for x in xs], [metrics[lang].get("unigram_bits_per_char", 0) for lang in langs], 0.4, label="unigram")
    ax.set_xticks(list(xs), langs)
    ax.set_ylabel("bits per character")
    ax.legend()
    return [(title, _save(fig, out / f"{name}-bpc.png"), "")]


def plot_fertility(m: dict[str, Any], out: Path, name: str) -> list[PlotResult]:
    """Tokens per word before and after the vocabulary extension, per language."""
    fert = _get(m.get("metrics", {}), "fertility") or {}
    langs = [k for k, v in fert.items() if isinstance(v, dict) and "before" in v and "after" in v]
    title = "Fertility (tokens per word) before and after extension"
    if not langs:
        return [(title, None, "no fertility before/after in the manifest")]
    fig, ax = _figure()
    xs = range(len(langs))
    ax.bar([x - 0.2 for x in xs], [fert[lang]["before"]["tokens_per_word"] for lang in langs], 0.4, label="base")
    ax.bar([x + 0.2 for x in xs], [fert[lang]["after"]["tokens_per_word"] for lang in langs], 0.4, label="extended")
    ax.set_xticks(list(xs), langs)
    ax.set_ylabel("tokens per word (held-out)")
    ax.legend()
    return [(title, _save(fig, out / f"{name}-fertility.png"), "")]


def plot_quantization(m: dict[str, Any], out: Path, name: str) -> list[PlotResult]:
    """Relative perplexity increase of the method and of RTN, per language."""
    metrics = m.get("metrics", {})
    ours, rtn = metrics.get("perplexity_increase_rel") or {}, metrics.get("rtn_perplexity_increase_rel") or {}
    title = f"Perplexity increase: {metrics.get('method', m.get('stage'))} vs RTN"
    langs = sorted(ours)
    if not langs:
        return [(title, None, "no perplexity_increase_rel in the manifest")]
    fig, ax = _figure()
    xs = range(len(langs))
    ax.bar([x - 0.2 for x in xs], [100 * ours[lang] for lang in langs], 0.4, label=str(metrics.get("method", "method")))
    ax.bar([x + 0.2 for x in xs], [100 * rtn.get(lang, 0.0) for lang in langs], 0.4, label="RTN")
    ax.set_xticks(list(xs), langs)
    ax.set_ylabel("perplexity increase (%)")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.legend()
    return [(title, _save(fig, out / f"{name}-quant.png"), "")]


PLOTS: dict[str, Callable[[dict[str, Any], Path, str], list[PlotResult]]] = {
    "bootstrap": plot_bootstrap,
    "tokenizer_ext.extend": plot_fertility,
    "quantize.awq": plot_quantization,
    "quantize.gptq": plot_quantization,
    "quantize.rtn": plot_quantization,
}


def draw_plots(manifest: dict[str, Any], out: Path, name: str) -> list[PlotResult]:
    """Every plot registered for the manifest's stage (none for stages without plots)."""
    fn = PLOTS.get(manifest.get("stage", ""))
    return fn(manifest, out, name) if fn else []
