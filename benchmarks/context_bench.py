"""Context extension side by side: no scaling, PI, NTK, YaRN, YaRN+ft and PI+ft on one model.

Every method is evaluated in this one process on the same weights, the same held-out
passkey prompts (same keys, depths and filler for every method) and the same perplexity text;
the two fine-tunes see byte-identical batches. The work is the ``context_ext.yarn`` stage's
own code (``context_ext.yarn_stage.run``), so the figures are the stage's.

CPU example (the tiny default base from ``warsha run recipes/arabic-tiny.yaml --only
bootstrap``; about 20-40 minutes on 2 idle cores)::

    .venv/bin/python -m benchmarks.context_bench --model runs/arabic-tiny/bootstrap

A quick look (fewer steps and trials; figures then carry wide intervals)::

    .venv/bin/python -m benchmarks.context_bench --model runs/arabic-tiny/bootstrap \\
        --steps 50 --max-trials 40 --half-width 0.15

Writes ``benchmarks/results/context_bench.json`` (metrics, settings, timings) plus the
stage's table and plot under ``benchmarks/results/context_bench/``; prints the table.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
from warsha.cli import quiet_environment  # noqa: E402

quiet_environment()  # offline, and none of the libraries' every-run warnings (as the `warsha` CLI)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        type=Path,
        default=REPO / "runs" / "arabic-tiny" / "bootstrap",
        help="unscaled HF model directory (RoPE)",
    )
    ap.add_argument("--method", default="yarn", choices=["yarn", "linear", "ntk"])
    ap.add_argument("--factor", type=float, default=4.0)
    ap.add_argument(
        "--target-length",
        type=int,
        default=0,
        help="fine-tune row length (0: original x factor); e.g. factor 8 on 4x rows, as YaRN trains short, tests long",
    )
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--answer-weight", type=float, default=5.0)
    ap.add_argument("--retrieval-fraction", type=float, default=0.5)
    ap.add_argument("--copy-fraction", type=float, default=0.0, help="share of repeated-span copy rows")
    ap.add_argument("--curriculum", type=float, default=0.0, help="share of steps ramping length up")
    ap.add_argument("--lm-positions", type=float, default=1.0, help="share of corpus targets scored")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--min-trials", type=int, default=40)
    ap.add_argument("--max-trials", type=int, default=400)
    ap.add_argument("--half-width", type=float, default=0.05)
    ap.add_argument("--finetune-baselines", default="linear", help="comma list fine-tuned with the same budget")
    ap.add_argument("--baselines", default="none,linear,ntk,yarn", help="comma list evaluated without fine-tuning")
    ap.add_argument("--ppl-documents", type=int, default=2)
    ap.add_argument("--lang", default=None, help="text language (default: corpus target, ar)")
    ap.add_argument("--collections", default="bukhari,muslim", help="hadith collections to read")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--fresh", action="store_true", help="discard cached fine-tunes and evaluations")
    return ap.parse_args()


def main() -> None:
    from warsha import runtime

    runtime.apply(reexec=True)  # allocator and threads before the first tensor
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from context_ext.stages import YarnParams
    from context_ext.yarn_stage import run
    from warsha.data import DataConfig, load_corpus
    from warsha.stage import StageContext
    from warsha.tracking import Tracker

    if not (args.model / "config.json").is_file():
        sys.exit(f"--model: no config.json in {args.model}; run the bootstrap stage first (see the docstring)")
    work = args.out / "context_bench"
    if args.fresh:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(DataConfig(collections=args.collections.split(",")))
    ctx = StageContext(
        stage="context_ext.yarn",
        stage_id="bench",
        recipe=None,
        out_dir=work,  # type: ignore[arg-type]
        inputs={"model": args.model},
        input_manifests={"model": None},
        checkpoint_dir=work / "checkpoints",
        tracker=Tracker(),
        device="cpu",
        seed=0,
        _corpus=corpus,
    )
    params = YarnParams(
        method=args.method,
        factor=args.factor,
        target_length=args.target_length or None,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        answer_weight=args.answer_weight,
        retrieval_fraction=args.retrieval_fraction,
        copy_fraction=args.copy_fraction,
        curriculum=args.curriculum,
        lm_positions=args.lm_positions,
        warmup_steps=args.warmup_steps,
        checkpoint_every=args.checkpoint_every,
        min_trials=args.min_trials,
        max_trials=args.max_trials,
        ci_half_width=args.half_width,
        lang=args.lang,
        ppl_documents=args.ppl_documents,
        finetune_baselines=[m for m in args.finetune_baselines.split(",") if m],
        baselines=[m for m in args.baselines.split(",") if m],
    )
    t0 = time.perf_counter()
    metrics = run(ctx, params)
    wall = time.perf_counter() - t0
    table = (work / "context_ext.md").read_text()
    print(table)
    result = {
        "model": str(args.model),
        "args": {k: str(v) for k, v in vars(args).items()},
        "wall_time_s": wall,
        "metrics": metrics,
    }
    (args.out / "context_bench.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out / 'context_bench.json'} and {work / 'context_ext.png'} ({wall / 60:.1f} min)")


if __name__ == "__main__":
    main()
