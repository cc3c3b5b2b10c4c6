"""Measurements of the drafts and the tables and plot the stage writes beside them.

Every figure comes from ``warsha.speculative`` and ``warsha.evaluate`` (the serving check counts
the same quantities in ``serve/stats.py``, defined alike in docs/metrics.md); this file only
chooses the held-out data and lays out results.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distill.draft_vocab import mask_outside

if TYPE_CHECKING:
    from distill.stages import DraftParams
    from warsha.stage import StageContext


def spec_prompts(held_out: list[list[int]], n: int, length: int) -> list[list[int]]:
    """The first ``n`` held-out documents long enough to give a ``length``-token prompt."""
    prompts = [d[:length] for d in held_out if len(d) > length]
    if not prompts:
        raise ValueError(f"spec_prompt_len: no validation document has more than {length} tokens")
    # alternate ends of the list: target-language documents come first, source-language last
    mixed = [x for pair in zip(prompts, reversed(prompts)) for x in pair]
    return list(dict.fromkeys(map(tuple, mixed)))[:n]  # type: ignore[arg-type]


def pooled(per_language: dict[str, dict[str, float]]) -> dict[str, float]:
    """Acceptance over every position of every language: the position-weighted mean."""
    total = sum(r["positions"] for r in per_language.values())
    keys = [k for k in next(iter(per_language.values())) if k != "positions"]
    out = {k: sum(r[k] * r["positions"] for r in per_language.values()) / total for k in keys}
    return {**out, "positions": total}


def measure(
    ctx: "StageContext",
    p: "DraftParams",
    target: Any,
    models: dict[str, Any],
    tokenizer: Any,
    texts: dict[str, list[str]],
    served_ids: list[int] | None = None,
) -> dict[str, Any]:
    """Analytic acceptance for every draft, empirical runs and speedups for the trained ones.

    ``texts`` holds the held-out documents by language, the target language first. Acceptance
    is reported over all of them and per language (``acceptance_by_language``): a draft for an
    Arabic model is judged on Arabic, and the pooled figure hides which language it serves worse.

    With ``served_ids``, acceptance, the cost ratio and speculation use the drafts restricted to
    those ids, as serve runs them (bits per character stay over the full vocabulary)."""
    from distill.data import encode_docs

    served = served_ids or []
    by_lang = {lang: [d[: p.eval_len] for d in encode_docs(tokenizer, ts)] for lang, ts in texts.items()}
    out = _teacher_forced(ctx, p, target, models, tokenizer, texts, by_lang, served)
    if served:
        models = {k: mask_outside(m, served) for k, m in models.items()}
    with decode_threads(p.decode_threads):
        held_out = [d for docs in by_lang.values() for d in docs]
        _decoding(ctx, p, target, models, held_out, out)
    return out


@contextlib.contextmanager
def decode_threads(n: int) -> Iterator[None]:
    """``n`` intra-op threads inside (0: leave the setting as it is), restored after.

    Batch-1 decoding of a small model is per-call overhead, not arithmetic: on a shared CPU a
    second intra-op thread only adds synchronisation (measured several times slower). The
    teacher-forced scoring before it is arithmetic over whole documents and the 278k-row head,
    and keeps every thread (at one thread it cost the real recipe's draft stage about 90 s)."""
    import torch

    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _teacher_forced(
    ctx: "StageContext",
    p: "DraftParams",
    target: Any,
    models: dict[str, Any],
    tokenizer: Any,
    texts: dict[str, list[str]],
    by_lang: dict[str, list[list[int]]],
    served_ids: list[int],
) -> dict[str, Any]:
    """Bits per character of every model and each draft's analytic acceptance, per language
    (``by_lang``: the documents of ``texts`` encoded and cut to ``eval_len``)."""
    from warsha.evaluate import likelihood
    from warsha.speculative import analytic_acceptance

    temps = sorted({0.0, 1.0, *p.spec_temperatures})
    out: dict[str, Any] = {
        "acceptance": {},
        "acceptance_by_language": {},
        "bits_per_char": {},
        "speculative": {},
        "speedup": {},
    }
    target_texts = next(iter(texts.values()))
    for name, model in [("target", target), *models.items()]:
        lk = likelihood(model, tokenizer, target_texts, p.eval_len, desc=f"bpc {name}")
        out["bits_per_char"][name] = lk.bits_per_char
        if name != "target":
            view = mask_outside(model, served_ids) if served_ids else model
            per = {
                lang: analytic_acceptance(target, view, docs, temps, p.eval_len)
                for lang, docs in by_lang.items()
                if docs
            }
            out["acceptance_by_language"][name] = per
            out["acceptance"][name] = pooled(per)
            ctx.tracker.log({f"acceptance/{name}/{k}": v for k, v in out["acceptance"][name].items()})
    for ref in ("baseline", "init"):
        if ref in out["acceptance"]:
            out[f"gain_over_{ref}"] = {
                k: out["acceptance"]["distilled"][k] - out["acceptance"][ref][k]
                for k in out["acceptance"][ref]
                if k != "positions"
            }
    out["acceptance_over"] = f"{len(served_ids)} served ids" if served_ids else "full vocabulary"
    return out


def _decoding(
    ctx: "StageContext",
    p: "DraftParams",
    target: Any,
    models: dict[str, Any],
    held_out: list[list[int]],
    out: dict[str, Any],
) -> None:
    """The cost ratio, plain decoding speed and speculative runs (on prompts from ``held_out``),
    written into ``out``."""
    from warsha.speculative import measure_cost_ratio, plain_tokens_per_s

    out["cost"] = measure_cost_ratio(target, models["distilled"], context=p.spec_prompt_len + p.spec_new_tokens)
    prompts = spec_prompts(held_out, p.spec_prompts, p.spec_prompt_len)
    out["plain_tokens_per_s"] = {
        f"t{t:g}": plain_tokens_per_s(target, prompts, p.spec_new_tokens, t, ctx.seed) for t in p.spec_temperatures
    }
    # "Before distillation" is the no-teacher baseline when one was trained, else the initial draft.
    for name in ("distilled", "baseline" if "baseline" in models else "init"):
        if name in models:
            out["speculative"][name], out["speedup"][name] = _speculate(ctx, p, target, models[name], prompts, out)


def _speculate(
    ctx: "StageContext", p: "DraftParams", target: Any, draft: Any, prompts: list[list[int]], out: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per temperature and ``k``: the counts of real runs, Leviathan's expected speedup from
    the measured per-token acceptance and cost ratio, and the wall-clock ratio to the plain
    target decode (which, at tiny sizes on CPU, per-call overhead dominates)."""
    from warsha.speculative import best_window, empirical_acceptance, expected_speedup

    c = out["cost"]["cost_ratio"]
    runs: dict[str, Any] = {}
    speed: dict[str, Any] = {}
    for t in p.spec_temperatures:
        key = f"t{t:g}"
        stats = empirical_acceptance(target, draft, prompts, p.spec_ks, t, p.spec_new_tokens, ctx.seed)
        runs[key] = {str(k): s.as_dict() for k, s in stats.items()}
        verified = max(sum(s.verified for s in stats.values()), 1)
        alpha = sum(s.accepted for s in stats.values()) / verified
        analytic = sum(s.analytic_on_visited * s.verified for s in stats.values()) / verified
        k_best, s_best = best_window(alpha, c, max(p.spec_ks))
        speed[key] = {
            "alpha": alpha,
            "analytic_on_visited": analytic,
            "verified": verified,
            "expected": {str(k): expected_speedup(alpha, k, c) for k in p.spec_ks},
            "best_k": k_best,
            "best_expected": s_best,
            "measured": {
                str(k): s.as_dict()["tokens_per_s"] / out["plain_tokens_per_s"][key] for k, s in stats.items()
            },
        }
        ctx.tracker.log({f"spec/{key}/alpha": alpha, f"spec/{key}/best_expected": s_best})
    return runs, speed


def write_report(metrics: dict[str, Any], out_dir: Path) -> None:
    """``acceptance.md`` (tables) and ``acceptance_vs_k.png`` next to the draft."""
    lines = [
        "# Draft acceptance",
        "",
        "Analytic per-token acceptance, sum min(p, q), teacher-forced on validation text:",
        "",
        "| draft | alpha T=0 | alpha T=1 | bits/char (target language) |",
        "|---|---|---|---|",
    ]
    for name, acc in metrics["acceptance"].items():
        lines.append(f"| {name} | {acc['t0']:.3f} | {acc['t1']:.3f} | {metrics['bits_per_char'][name]:.3f} |")
    lines.append(f"| target | 1 | 1 | {metrics['bits_per_char']['target']:.3f} |")
    by_lang = metrics.get("acceptance_by_language", {})
    if by_lang:
        langs = list(next(iter(by_lang.values())))
        lines += [
            "",
            "By language, alpha T=0:",
            "",
            "| draft | " + " | ".join(langs) + " |",
            "|---|" + "---|" * len(langs),
        ]
        for name, per in by_lang.items():
            lines.append(f"| {name} | " + " | ".join(f"{per[lang]['t0']:.3f}" for lang in langs) + " |")
    c = metrics["cost"]
    lines += [
        "",
        f"Cost ratio c (draft/target decode step): {c['cost_ratio']:.3f}"
        f" ({c['draft_ms']:.2f} ms / {c['target_ms']:.2f} ms)",
        "",
    ]
    for name, per_t in metrics["speculative"].items():
        for t, per_k in per_t.items():
            sp = metrics["speedup"][name][t]
            lines += [
                f"## {name}, {t}",
                "",
                f"Per-token acceptance over all k: empirical {sp['alpha']:.3f},"
                f" analytic on the same contexts {sp['analytic_on_visited']:.3f} ({sp['verified']} positions);"
                f" best k {sp['best_k']} (expected speedup {sp['best_expected']:.2f})",
                "",
                "| k | acceptance rate | per-token | analytic (visited) |"
                " mean accepted length | expected speedup | measured speedup |",
                "|---|---|---|---|---|---|---|",
            ]
            for k, s in per_k.items():
                lines.append(
                    f"| {k} | {s['acceptance_rate']:.3f} | {s['per_token_acceptance']:.3f} |"
                    f" {s['analytic_on_visited']:.3f} | {s['mean_accepted_length']:.2f} |"
                    f" {sp['expected'][k]:.2f} | {sp['measured'][k]:.2f} |"
                )
            lines.append("")
    (out_dir / "acceptance.md").write_text("\n".join(lines) + "\n")
    _plot(metrics, out_dir / "acceptance_vs_k.png")


def _plot(metrics: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, per_t in metrics["speculative"].items():
        for t, per_k in per_t.items():
            ks = [int(k) for k in per_k]
            ax.plot(ks, [per_k[str(k)]["mean_accepted_length"] for k in ks], marker="o", label=f"{name} {t}")
    ax.set_xlabel("k (draft tokens per round)")
    ax.set_ylabel("tokens per target forward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
