"""Write a copy of a base model that retrieves a passkey at its own context, as real bases do.

Why: the YaRN paper extends Llama-2, which already finds a passkey anywhere in its 4k window;
extension then only has to carry that skill to longer positions. The demo's small bootstrap
has no induction circuit, so on it the passkey table measures nothing about the extension. This
script trains a copy of the base, at lengths up to its original context only, on rows that grow
the circuit quickly, so that ``benchmarks/context_bench.py`` can measure whether YaRN (or PI,
or NTK) with a short fine-tune keeps retrieval at 4x and 8x.

Rows (each step holds ``--tokens`` tokens; row length drawn from ``--lengths``):
- passkey rows: ``context_ext.passkey`` training samples (training keys and depths, train-split
  filler; the evaluation's keys, depths and held-out filler never appear), loss on the answer
  and on the needle's second mention of the key;
- digit rows: a random digit string repeated to fill the row, loss on every repeated digit:
  the densest copy signal, which is what lets the later digits of a key be learned at all;
- corpus rows (``--lm-fraction``): plain next-token loss on train-split text, to keep the language.

The copy circuit forms in a sudden phase change whose timing depends on the data order, so
the middle phase trains until the accuracy at the context passes ``--stop-at``, and the rate
stays constant while it forms (``--schedule constant``; a decaying rate stalls it). The stand-in
behind the README's yarn rows is grown from the demo's bootstrap in four phases (what each phase
reached is in docs/results.md)::

    S=".venv/bin/python -m benchmarks.retrieval_standin"
    $S --model runs/arabic-tiny/bootstrap --out /tmp/r1 --lengths 64 --digit-fraction 0.5 --lm-fraction 0 \\
        --steps 400 --stop-at 1.01
    $S --model /tmp/r1 --out /tmp/r2 --steps 1000 --stop-at 1.01
    $S --model /tmp/r2 --out /tmp/r3 --seed 2 --steps 1500 --stop-at 0.85
    $S --model /tmp/r3 --out runs/bootstrap-retrieval --lengths 128,256 --steps 200 --lr 5e-4 \\
        --schedule cosine --trials 100 --stop-at 1.01
    .venv/bin/python -m benchmarks.context_bench --model runs/bootstrap-retrieval --factor 8 \\
        --target-length 1024 --batch-size 2 --lr 3e-4 --curriculum 0.5 --lm-positions 0.5 \\
        --max-trials 120 --ppl-documents 1

Corpus rows are in ``--lang`` only, so the stand-in forgets the other language: read its
other-language short-context column as meaningless.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from warsha.cli import quiet_environment

quiet_environment()  # offline, and none of the libraries' every-run warnings (as the `warsha` CLI)

from context_ext import passkey  # noqa: E402
from context_ext.retrieval_rows import RowMix, check, digit_ids, rate, row_lengths  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", type=Path, required=True, help="HF base model directory (RoPE, digit-splitting tokenizer)"
    )
    ap.add_argument("--out", type=Path, required=True, help="where the stand-in is written (HF directory)")
    ap.add_argument("--steps", type=int, default=1400, help="training steps (stops early at --stop-at)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW peak rate (3e-3 stalled the later digits)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per step")
    ap.add_argument("--lengths", default="64,128,256", help="row lengths, each <= the model's context")
    ap.add_argument("--digit-fraction", type=float, default=0.35, help="share of digit-copy rows")
    ap.add_argument("--lm-fraction", type=float, default=0.15, help="share of corpus rows")
    ap.add_argument(
        "--schedule",
        choices=("constant", "cosine"),
        default="constant",
        help="learning rate after 10 warm-up steps: constant grows the copy circuit, cosine settles it",
    )
    ap.add_argument("--eval-every", type=int, default=100, help="steps between passkey checks at the context")
    ap.add_argument("--trials", type=int, default=40, help="passkey trials per check")
    ap.add_argument("--stop-at", type=float, default=0.95, help="stop once accuracy at the context reaches this")
    ap.add_argument("--lang", default="ar", help="filler and corpus language")
    ap.add_argument("--collections", default="", help="hadith collections to read (default: all)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("steps", "tokens", "eval_every", "trials"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.digit_fraction + args.lm_fraction < 1:
        ap.error("--digit-fraction + --lm-fraction must be in [0, 1): the rest are passkey rows")
    if not (args.model / "config.json").is_file():
        ap.error(
            f"--model: no config.json in {args.model}; run `warsha run recipes/arabic-tiny.yaml --only bootstrap` first"
        )
    return args


def save(model: Any, tokenizer: Any, out: Path, report: dict[str, Any]) -> None:
    """Write the stand-in atomically: a half-written directory never replaces a good one."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "retrieval_standin.json").write_text(json.dumps(report, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main(argv: Sequence[str] | None = None) -> None:
    from warsha import runtime

    runtime.apply(reexec=True)  # allocator and threads before the first tensor
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from context_ext.longdata import heldout_texts, train_texts
    from warsha.data import DataConfig, load_corpus
    from warsha.lm_loss import weighted_lm_loss
    from warsha.progress import progress

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    context = int(model.config.max_position_embeddings)
    lengths = row_lengths(args.lengths, context)
    data = DataConfig(collections=args.collections.split(",")) if args.collections else DataConfig()
    corpus = load_corpus(data)
    texts = train_texts(corpus, args.lang)
    random.Random(args.seed).shuffle(texts)
    half = min(2000, len(texts) // 2)  # filler and corpus rows from different documents
    fmt = passkey.PasskeyFormat(tokenizer)
    filler = passkey.filler_stream(tokenizer, texts[:half])
    eval_filler = passkey.filler_stream(tokenizer, heldout_texts(corpus, args.lang)[:500])
    mix = RowMix(
        fmt,
        filler,
        passkey.filler_stream(tokenizer, texts[half : half + 4000]),
        digit_ids(tokenizer),
        lengths,
        args.tokens,
        args.digit_fraction,
        args.lm_fraction,
        args.seed,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    curve: list[dict[str, float]] = []
    t0 = time.perf_counter()
    bar = progress(range(args.steps), desc="retrieval stand-in", unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = rate(args.lr, step, args.steps, args.schedule)
        loss = weighted_lm_loss(model, mix(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            acc = check(model, fmt, eval_filler, context, args.trials)
            curve.append({"step": step + 1, "passkey_at_context": acc, "minutes": (time.perf_counter() - t0) / 60})
            bar.write(f"step {step + 1}: passkey at {context} tokens {acc:.0%} ({args.trials} trials)")
            if acc >= args.stop_at:
                break
    report = {
        "base": str(args.model),
        "context": context,
        "curve": curve,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    save(model, tokenizer, args.out, report)
    print(json.dumps(report["curve"][-1] if curve else {}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
