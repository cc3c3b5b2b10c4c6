"""The report's plots, one function per stage, each reading only that stage's manifest.

A plot function returns ``(title, png path or None, note)``; None with a note says which metric
was missing, so a gap in the report is visible rather than silent.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    ax.bar(
        [x + 0.2 for x in xs], [metrics[lang].get("unigram_bits_per_char", 0) for lang in langs], 0.4, label="unigram"
    )
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


def plot_adaptation(m: dict[str, Any], out: Path, name: str) -> list[PlotResult]:
    """Held-out bits per character against training step, extended model and base control, on the
    corpus's held-out text (circles) and on the other-domain sets (squares), one line style per set."""
    metrics = m.get("metrics", {})
    runs = {
        label: _get(metrics, key, "bits_per_char_curve")
        for key, label in (("extended", "extended"), ("base_same_budget", "base, same budget"))
    }
    runs = {k: v for k, v in runs.items() if v}
    title = "Adaptation: held-out bits per character during training, in and out of domain"
    if not runs:
        return [(title, None, "no bits_per_char_curve in the manifest (set train.eval_every)")]
    fig, ax = _figure()
    styles = ["-", "--", "-.", ":", (0, (5, 1)), (0, (1, 3)), (0, (3, 1, 1, 1))]
    for color, (label, curve) in zip(("C0", "C1"), runs.items()):
        keys = list(dict.fromkeys(k for c in curve for k in c if k != "step"))
        for key, style in zip(keys, styles):
            pts = [(c["step"], c[key]) for c in curve if key in c]
            marker = "o" if key in ("ar", "en") else "s"
            ax.plot(*zip(*pts), linestyle=style, color=color, marker=marker, markersize=3, label=f"{label} ({key})")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per character (held-out)")
    ax.legend(fontsize=8)
    return [(title, _save(fig, out / f"{name}-bpc-curve.png"), "")]


def plot_latency(m: dict[str, Any], out: Path, name: str) -> list[PlotResult]:
    """Per-request TTFT and TPOT, with and without the draft, at each batch size."""
    metrics = m.get("metrics", {})
    batches = sorted(
        (k for k in metrics if k.startswith("batch") and isinstance(metrics[k], dict)), key=lambda k: int(k[5:])
    )
    results = []
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT")):
        series = {
            f"{b[5:]} {mode}": metrics[b][mode][key]
            for b in batches
            for mode in ("plain", "speculative")
            if _get(metrics, b, mode, key)
        }
        title = f"{label} per request (batch size, engine)"
        if not series:
            results.append((title, None, f"no per-request {key} in the manifest"))
            continue
        fig, ax = _figure()
        ax.boxplot([[1000 * v for v in vals] for vals in series.values()], showmeans=True)
        ax.set_xticks(range(1, len(series) + 1), list(series), fontsize=8)
        ax.set_ylabel(f"{label} (ms)")
        results.append((title, _save(fig, out / f"{name}-{label.lower()}.png"), ""))
    return results


PLOTS: dict[str, Callable[[dict[str, Any], Path, str], list[PlotResult]]] = {
    "bootstrap": plot_bootstrap,
    "tokenizer_ext.adapt": plot_adaptation,
    "serve.validate": plot_latency,
    "tokenizer_ext.extend": plot_fertility,
    "quantize.awq": plot_quantization,
    "quantize.gptq": plot_quantization,
    "quantize.rtn": plot_quantization,
}


def draw_plots(manifest: dict[str, Any], out: Path, name: str) -> list[PlotResult]:
    """Every plot registered for the manifest's stage (none for stages without plots)."""
    fn = PLOTS.get(manifest.get("stage", ""))
    return fn(manifest, out, name) if fn else []


def quant_rows(manifests: list[tuple[str, dict[str, Any]]]) -> dict[str, tuple[dict[str, float], float | None]]:
    """Perplexity per language and size on disk, per method, for the run's quantized model.

    Only the quantize stages of the model most of them quantize take part: a recipe that also
    quantizes its draft (a different model, scored on other text) would otherwise put the
    draft's perplexity on the target's axis."""
    quantized = [
        (n, m)
        for n, m in manifests
        if m.get("stage", "").startswith("quantize.") and "quantized" in m.get("metrics", {})
    ]
    sources = [_model_input(m) for _, m in quantized]
    main = max(sources, key=sources.count, default=None)
    rows: dict[str, tuple[dict[str, float], float | None]] = {}
    for name, m in quantized:
        if _model_input(m) != main:
            continue
        metrics = m["metrics"]

        def ppl(key: str, metrics: dict = metrics) -> dict[str, float]:
            return {lang: v["perplexity"] for lang, v in (metrics.get(key) or {}).items()}

        rows.setdefault("unquantized", (ppl("unquantized"), metrics.get("input_size_bytes")))
        rows.setdefault("rtn", (ppl("rtn"), None))
        method = str(metrics.get("method", name))
        label = method if method == name else f"{method} ({name})"
        label += ", int8 embedding" if metrics.get("embedding_bits") == 8 else ""
        rows[label] = (ppl("quantized"), metrics.get("size_bytes"))
    for _, m in manifests:
        if m.get("stage") == "quantize.gguf" and _model_input(m) == main:
            rows.update(gguf_rows(m.get("metrics", {})))
    return rows


def gguf_rows(metrics: dict[str, Any]) -> dict[str, tuple[dict[str, float], float | None]]:
    """One row per llama.cpp type of a ``quantize.gguf`` stage (``GGUF Q4_K_M``): perplexity
    per language on the same held-out windows as the other methods, and the file's size."""
    rows: dict[str, tuple[dict[str, float], float | None]] = {}
    for name, t in (metrics.get("types") or {}).items():
        ppl = {lang: v["perplexity"] for lang, v in t.items() if isinstance(v, dict) and "perplexity" in v}
        rows[f"GGUF {name}"] = (ppl, t.get("size_bytes"))
    return rows


def _model_input(manifest: dict[str, Any]) -> str | None:
    """The path of a stage's `model` input, from its manifest."""
    return next((str(i.get("path")) for i in manifest.get("inputs") or [] if i.get("role") == "model"), None)


def plot_quant_summary(manifests: list[tuple[str, dict[str, Any]]], out: Path) -> list[PlotResult]:
    """Perplexity per language and size on disk for every quantization method in the run.

    A run-level plot: each quantize stage records its own method, RTN and the unquantized
    model on the same text, so methods are compared on one axis.
    """
    rows = quant_rows(manifests)
    title = "Quantization: perplexity per language and size on disk, per method"
    if len(rows) < 3:
        return [(title, None, "no quantize stage with quantized/rtn/unquantized perplexity in this run")]
    import matplotlib.pyplot as plt

    langs = sorted({lang for ppl, _ in rows.values() for lang in ppl})
    fig, (ax, ax_size) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    width = 0.8 / len(rows)
    for i, (label, (ppl, _)) in enumerate(rows.items()):
        ax.bar([x + i * width for x in range(len(langs))], [ppl.get(lang, 0.0) for lang in langs], width, label=label)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(langs))], langs)
    ax.set_ylabel("perplexity (held-out)")
    ax.legend(fontsize=7)
    sized = [(label, size / 2**20) for label, (_, size) in rows.items() if size]
    ax_size.barh([label for label, _ in sized], [mb for _, mb in sized])
    ax_size.set_xlabel("size on disk (MiB)")
    return [(title, _save(fig, out / "quantization-summary.png"), "")]
