"""Draft distillation side by side on one target: what the teacher buys in acceptance.

Drafts compared in one process, on the same target, the same data and the same step budget:

- ``init``: the draft as built (layer subset or smaller config), untrained;
- ``baseline``: trained without the teacher (plain next-token loss on corpus chunks);
- ``fkl`` / ``tvd`` / ...: distilled with that divergence (off-policy + on-policy data);

and, for the speculative loop itself, transformers' assisted generation (``generate`` with
``assistant_model``) as the peer: both are exact, so both must emit target-quality text, and
their speed on this CPU is put beside the target decoding alone.

CPU examples (one intra-op thread: on a shared 2-core machine it was 3-40x faster)::

    # a target: the pipeline's output, or train a small one here (bootstrap recipe, 50% Arabic)
    .venv/bin/python -m benchmarks.distill_bench target --out /tmp/distill_target --steps 240
    .venv/bin/python -m benchmarks.distill_bench run --target /tmp/distill_target --steps 150
    # a narrow draft (hidden 64, projected embeddings) with its own same-size baseline
    .venv/bin/python -m benchmarks.distill_bench run --target /tmp/distill_target --losses \
        --config-hidden 64 --tag narrow

Prints a table and writes ``benchmarks/results/distill_bench.json``. Never run in CI.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "distill_bench.json"


def make_ctx(out: Path, model_dir: Path | None, seed: int = 0) -> Any:
    """A StageContext over the full hadith corpus with a no-op tracker."""
    from warsha.config import Recipe
    from warsha.data import DataConfig
    from warsha.stage import StageContext
    from warsha.tracking import Tracker

    out.mkdir(parents=True, exist_ok=True)
    return StageContext(
        stage="bench",
        stage_id="bench",
        recipe=Recipe(name="bench", data=DataConfig()),
        out_dir=out,
        inputs={"model": model_dir} if model_dir else {},
        input_manifests={},
        checkpoint_dir=out / "ckpt",
        tracker=Tracker(),
        device="cpu",
        seed=seed,
        log=logging.getLogger("bench"),
    )


def train_target(args: argparse.Namespace) -> None:
    """The bootstrap stage with a larger Arabic share: a stand-in for the adapted target."""
    from warsha.bootstrap import STAGE
    from warsha.schema import from_dict

    problems: list[str] = []
    params = from_dict(
        STAGE.params,
        {
            "arabic_share": 0.5,
            "max_train_tokens": 3_000_000,
            "eval_documents": 50,
            "train": {
                "steps": args.steps,
                "batch_size": 8,
                "seq_len": 128,
                "lr": 2e-3,
                "warmup_steps": 20,
                "checkpoint_every": 40,
            },
        },
        "params",
        problems,
    )
    assert not problems, problems
    metrics = STAGE.run(make_ctx(Path(args.out), None), params)
    print(json.dumps({k: metrics[k] for k in ("ar", "en", "train")}, indent=1))


def variants(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """Draft variants: distilled with each divergence, and a narrower config draft."""
    out = [(f"layers{args.layers}-{loss}", {"loss": loss, "baseline": i == 0}) for i, loss in enumerate(args.losses)]
    if args.config_hidden:
        h = args.config_hidden
        out.append(
            (
                f"config-h{h}-fkl",
                {
                    "method": "config",
                    "hidden_size": h,
                    "intermediate_size": h * 11 // 4,
                    "num_layers": 1,
                    "num_heads": 4,
                    "num_kv_heads": 2,
                    "loss": "fkl",
                    "baseline": True,
                },
            )
        )
    return out


def run_bench(args: argparse.Namespace) -> None:
    """Run distill.draft once per variant (the first also trains the baseline) and the peer."""
    from distill.stages import STAGES, DraftParams
    from warsha.schema import from_dict

    base = {
        "layers": args.layers,
        "max_train_documents": args.train_docs,
        "eval_documents": 48,
        "eval_len": 128,
        "spec_prompts": args.spec_prompts,
        "spec_new_tokens": 48,
        "on_policy_fraction": args.on_policy,
        "train": {
            "steps": args.steps,
            "batch_size": 8,
            "seq_len": 128,
            "lr": args.lr,
            "warmup_steps": 10,
            "checkpoint_every": 50,
        },
    }
    rows: dict[str, Any] = {}
    for i, (name, over) in enumerate(variants(args)):
        problems: list[str] = []
        params = from_dict(DraftParams, {**base, **over}, "params", problems)
        assert not problems, problems
        start = time.perf_counter()
        ctx = make_ctx(Path(args.work) / name, Path(args.target))
        rows[name] = STAGES["draft"].run(ctx, params)
        rows[name]["wall_s"] = time.perf_counter() - start
        if i == 0:
            rows["peer_hf_assisted"] = hf_assisted(Path(args.target), ctx.out_dir, ctx)
    results = RESULTS.with_name(f"distill_bench-{args.tag}.json") if args.tag else RESULTS
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(rows, indent=1))
    print_table(rows)


def hf_assisted(target_dir: Path, draft_dir: Path, ctx: Any, new_tokens: int = 48) -> dict[str, float]:
    """transformers' assisted generation (greedy) vs the target alone, same prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir).eval()
    texts = ctx.corpus().texts("ar", "validation")[:2] + ctx.corpus().texts("en", "validation")[:2]
    out: dict[str, float] = {}
    for label, kwargs in (("target_alone", {}), ("assisted", {"assistant_model": draft})):
        n, t0 = 0, time.perf_counter()
        for text in texts:
            ids = tok(text, return_tensors="pt").input_ids[:, :16]
            with torch.inference_mode():
                gen = target.generate(
                    ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs
                )
            n += gen.shape[1] - ids.shape[1]
        out[f"{label}_tokens_per_s"] = n / (time.perf_counter() - t0)
    out["speedup"] = out["assisted_tokens_per_s"] / out["target_alone_tokens_per_s"]
    return out


def print_table(rows: dict[str, Any]) -> None:
    """One line per draft: acceptance at T=0/1, best expected speedup, cost ratio."""
    print(f"{'draft':28} {'alpha T0':>9} {'alpha T1':>9} {'bpc':>7} {'c':>6} {'best k':>6} {'E[speedup]':>10}")
    for name, m in rows.items():
        if name.startswith("peer"):
            continue
        for d, acc in m["acceptance"].items():
            if d != "distilled" and "baseline" not in m["acceptance"]:
                continue
            sp = m["speedup"].get(d, {}).get("t1", {})
            label = name if d == "distilled" else f"{name} [{d}]"
            print(
                f"{label:28} {acc['t0']:9.3f} {acc['t1']:9.3f} {m['bits_per_char'][d]:7.3f}"
                f" {m['cost']['cost_ratio']:6.3f} {sp.get('best_k', '-')!s:>6} "
                f"{sp.get('best_expected', float('nan')):10.2f}"
            )
    for name, m in rows.items():
        if name.startswith("peer"):
            print(name, json.dumps(m))


def main() -> None:
    """Parse the command line."""
    from warsha import runtime
    from warsha.cli import quiet_environment

    quiet_environment()

    runtime.apply(reexec=True)  # allocator and threads before the first tensor
    import torch

    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("target")
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=int, default=240)
    r = sub.add_parser("run")
    r.add_argument("--target", required=True)
    r.add_argument("--work", default="/tmp/distill_bench")
    r.add_argument("--steps", type=int, default=150)
    r.add_argument("--lr", type=float, default=2e-3)
    r.add_argument("--layers", type=int, nargs="+", default=[0])
    r.add_argument("--losses", nargs="*", default=["fkl", "tvd"], help="layer-subset variants (none: skip)")
    r.add_argument("--on-policy", type=float, default=0.5)
    r.add_argument("--train-docs", type=int, default=4000)
    r.add_argument("--spec-prompts", type=int, default=4)
    r.add_argument("--config-hidden", type=int, default=0, help="also a 1-layer config draft of this width")
    r.add_argument("--tag", default="", help="suffix of the results file")
    args = ap.parse_args()
    train_target(args) if args.cmd == "target" else run_bench(args)


if __name__ == "__main__":
    main()
