"""``report.md`` for a run directory, built only from the artifacts' manifests.

Every figure in the report is read from a ``warsha.json``, never recomputed, so the report
cannot disagree with the artifacts. Plots are drawn by per-stage functions in
``warsha/report_plots.py``; a stage whose manifest lacks what a plot needs gets a visible note
instead of a silently missing figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from warsha.artifacts import read_manifest
from warsha.tracking import flatten

MAX_ROWS = 60


def collect(run_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Finished artifacts under ``run_dir``, in the order they were created."""
    dirs = [d for d in sorted(run_dir.iterdir()) if d.is_dir() and not d.name.startswith(".")]  # not .<id>.partial
    found = [(d, m) for d in dirs if (m := read_manifest(d)) is not None]
    return sorted(found, key=lambda dm: dm[1].get("created", ""))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= 120 else text[:117] + "..."


def metrics_table(metrics: dict[str, Any]) -> list[str]:
    """A two-column markdown table of a stage's scalar metrics."""
    rows = [(k, v) for k, v in flatten(metrics).items() if isinstance(v, (int, float, str, bool))]
    lines = ["| metric | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in rows[:MAX_ROWS]]
    if len(rows) > MAX_ROWS:
        lines.append(f"| ... | {len(rows) - MAX_ROWS} more in warsha.json |")
    return lines


def lineage(artifacts: list[tuple[Path, dict[str, Any]]]) -> list[str]:
    """Which artifact each stage was made from, with the input digests it recorded."""
    lines = ["| artifact | stage | made from | input sha256 |", "|---|---|---|---|"]
    for d, m in artifacts:
        ins = m.get("inputs", [])
        src = ", ".join(f"{i['role']}: `{Path(i['path']).name}`" for i in ins) or "nothing (trained here)"
        shas = ", ".join(i["sha256"][:12] for i in ins) or "-"
        lines.append(f"| `{d.name}` | {m['stage']} | {src} | {shas} |")
    return lines


def time_table(artifacts: list[tuple[Path, dict[str, Any]]]) -> list[str]:
    """Wall and CPU time per stage, and the run's system share of CPU time.

    The system share over the whole run is how the allocator policy is judged (a stage paying
    page faults for its allocations shows here first); stages written before manifests kept CPU
    time show a dash and are left out of the total.
    """
    lines = ["| artifact | wall s | CPU user s | CPU sys s | sys / user |", "|---|---|---|---|---|"]
    user = sys_ = 0.0
    for d, m in artifacts:
        cpu = m.get("cpu_time")
        if cpu is None:
            lines.append(f"| `{d.name}` | {m.get('wall_time_s', 0):.1f} | - | - | - |")
            continue
        user, sys_ = user + cpu["user_s"], sys_ + cpu["sys_s"]
        lines.append(
            f"| `{d.name}` | {m.get('wall_time_s', 0):.1f} | {cpu['user_s']:.1f} | {cpu['sys_s']:.1f} "
            f"| {cpu['sys_share']:.1%} |"
        )
    if user > 0:
        lines.append(
            f"| **all stages** | {sum(m.get('wall_time_s', 0) for _, m in artifacts):.1f} "
            f"| {user:.1f} | {sys_:.1f} | **{sys_ / user:.1%}** |"
        )
    return lines


def chat_section(artifacts: list[tuple[Path, dict[str, Any]]]) -> list[str]:
    """An instruct run's chat setup per artifact (a stage that lost the template shows "none") and
    the adaptation's chat answers (``tokenizer_ext.chat_quality``); nothing for a base-model run."""
    setups = [(d, m["chat"]) for d, m in artifacts if "chat" in m]
    if not any(c["chat_template"] for _, c in setups):
        return []
    lines = ["## Chat", "", "| artifact | chat template sha256 | stop ids |", "|---|---|---|"]
    for d, c in setups:
        sha = f"`{c['chat_template_sha256'][:12]}`" if c["chat_template"] else "**none**"
        lines.append(f"| `{d.name}` | {sha} | {', '.join(map(str, c['stop_ids'])) or '-'} |")
    for d, m in artifacts:
        models = [(n, m["metrics"][n]["chat"]) for n in _CHAT_MODELS if "chat" in m.get("metrics", {}).get(n, {})]
        if models:
            lines += ["", f"Chat answers in `{d.name}` (greedy, held-out questions):", ""]
            lines += chat_answers_table(models)
    return lines + [""]


_CHAT_MODELS = ("base_model", "base_same_budget", "extended")


def chat_answers_table(models: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Per model and language: turns ended, mean answer tokens, share of letters in the script
    asked, and the special tokens the answers emitted."""
    lines = [
        "| model | lang | turns ended | mean tokens | script share | special tokens |",
        "|---|---|---|---|---|---|",
    ]
    for name, chat in models:
        for lang in (k for k in chat if k not in ("special_tokens", "answers")):
            c = chat[lang]
            share = "-" if c["script_share"] is None else f"{c['script_share']:.1%}"
            specials = " ".join(f"`{t}`".replace("|", "\\|") for t in chat["special_tokens"]) or "-"
            lines.append(f"| {name} | {lang} | {c['turn_ended']:.0%} | {c['mean_tokens']:.1f} | {share} | {specials} |")
    return lines


def run_plots(artifacts: list[tuple[Path, dict[str, Any]]], plots_dir: Path, run_dir: Path) -> list[str]:
    """Plots that compare several stages of the run (e.g. every quantization method)."""
    from warsha.report_plots import plot_quant_summary

    lines = []
    named = [(d.name, m) for d, m in artifacts]
    for title, png, note in plot_quant_summary(named, plots_dir):
        if png is not None or any(m.get("stage", "").startswith("quantize.") for _, m in artifacts):
            lines += [f"## {title}", "", f"![{title}]({png.relative_to(run_dir)})" if png else f"_{note}_", ""]
            lines += quant_table(named) if png is not None else []
    return lines


def quant_table(named: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The quantization plot's figures as a table: perplexity per language, size in MiB."""
    from warsha.report_plots import quant_rows

    rows = quant_rows(named)
    langs = sorted({lang for ppl, _ in rows.values() for lang in ppl})
    out = ["| method | " + " | ".join(f"ppl {lang}" for lang in langs) + " | MiB |", "|---" * (len(langs) + 2) + "|"]
    for label, (ppl, size) in rows.items():
        cells = [f"{ppl[lang]:.3f}" if lang in ppl else "" for lang in langs]
        mib = f"{size / 2**20:.1f}" if size else ""
        out.append(f"| {label} | " + " | ".join(cells) + f" | {mib} |")
    return out + [""]


def write_report(run_dir: Path) -> Path:
    """Write ``report.md`` and its plots into ``run_dir``; return the report's path."""
    from warsha.report_plots import draw_plots

    artifacts = collect(run_dir)
    if not artifacts:
        raise FileNotFoundError(f"{run_dir}: no finished artifacts (no warsha.json) to report on")
    plots_dir = run_dir / "report"
    plots_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# Warsha run: {artifacts[0][1].get('recipe', run_dir.name)}",
        "",
        "Every figure below is read from the artifacts' `warsha.json` manifests.",
        "",
        "## Lineage",
        "",
        *lineage(artifacts),
        "",
        "## Time",
        "",
        *time_table(artifacts),
        "",
    ]
    lines += chat_section(artifacts)
    lines += run_plots(artifacts, plots_dir, run_dir)
    for d, m in artifacts:
        lines += [
            f"## {m['stage']} (`{d.name}`)",
            "",
            f"wall time {m.get('wall_time_s', 0):.1f} s, created {m.get('created')}, "
            f"config hash `{m.get('config_hash', '')[:12]}`",
            "",
        ]
        for title, png, note in draw_plots(m, plots_dir, d.name):
            lines += [f"**{title}**", ""]
            lines += [f"![{title}]({png.relative_to(run_dir)})" if png else f"_{note}_", ""]
        for png in sorted(d.glob("*.png")):
            lines += [f"![{png.stem}]({png.relative_to(run_dir)})", ""]
        lines += metrics_table(m.get("metrics", {})) + [""]
    out = run_dir / "report.md"
    out.write_text("\n".join(lines))
    return out
