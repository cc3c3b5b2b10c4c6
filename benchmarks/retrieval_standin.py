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

    S=".venv/bin/python benchmarks/retrieval_standin.py"
    $S --model runs/arabic-tiny/bootstrap --out /tmp/r1 --lengths 64 --digit-fraction 0.5 --lm-fraction 0 \\
        --steps 400 --stop-at 1.01
    $S --model /tmp/r1 --out /tmp/r2 --steps 1000 --stop-at 1.01
    $S --model /tmp/r2 --out /tmp/r3 --seed 2 --steps 1500 --stop-at 0.85
    $S --model /tmp/r3 --out runs/bootstrap-retrieval --lengths 128,256 --steps 200 --lr 5e-4 \\
        --schedule cosine --trials 100 --stop-at 1.01
    .venv/bin/python benchmarks/context_bench.py --model runs/bootstrap-retrieval --factor 8 \\
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
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from warsha.cli import quiet_environment  # noqa: E402

quiet_environment()  # offline, and none of the libraries' every-run warnings (as the `warsha` CLI)

from context_ext import passkey  # noqa: E402
from warsha import synthetic  # noqa: E402

DIGITS = "0123456789"


def digit_ids(tokenizer: Any) -> list[int]:
    """The ten single-digit tokens, as they occur inside a number (``" 0123456789"`` split).

    Refuses a tokenizer that merges digits: the rows below assume one token per digit, as the
    Llama and Mistral SentencePiece models (``split_digits``) give.
    """
    ids = list(tokenizer(" " + DIGITS, add_special_tokens=False)["input_ids"])[-10:]
    if len(set(ids)) != 10 or tokenizer.decode(ids).replace(" ", "") != DIGITS:
        raise ValueError("--model: its tokenizer does not split numbers into single digits; digit rows need it")
    return ids


def digit_row(digits: Sequence[int], length: int, rng: random.Random, bos: int | None) -> tuple[list[int], list[float]]:
    """BOS + a random string of 6-24 digits repeated to ``length`` tokens, with loss weights.

    Every digit of a repeat is a copy target (weight 1) except a repeat's first, which follows
    the previous repeat's last digit and is predictable only from the span length. Ten symbols,
    not the whole vocabulary: the copy circuit forms where each symbol recurs often (random
    tokens from a 20k vocabulary taught the demo model nothing in 375 steps).
    """
    span = [rng.choice(digits) for _ in range(rng.randint(6, 24))]
    return synthetic.fill_repeats(span, length, bos)


def passkey_row(
    fmt: passkey.PasskeyFormat, filler: Sequence[int], length: int, rng: random.Random
) -> tuple[list[int], list[float]]:
    """A training passkey sample; loss on the answer and on the needle's repeat of the key."""
    sample = passkey.make_sample(fmt, filler, length, passkey.train_depth(rng), rng, "train")
    ids, n = sample.input_ids, sample.answer_len
    weights = [0.0] * (length - n) + [1.0] * n
    key = ids[-n:]
    mentions = [i for i in range(length - n) if ids[i : i + n] == key]
    if len(mentions) >= 2:  # the second mention's digits after the first are copies of the first's
        for j in range(mentions[1] + 2, mentions[1] + n):
            weights[j] = 1.0
    return ids, weights


@dataclass
class RowMix:
    """Batches of passkey, digit and corpus rows; each step a pure function of (seed, step)."""

    fmt: passkey.PasskeyFormat
    filler: list[int]
    corpus: list[int]
    digits: list[int]
    lengths: list[int]
    tokens: int
    digit_fraction: float
    lm_fraction: float
    seed: int = 0

    def __call__(self, step: int) -> dict[str, Any]:
        import torch

        rng = random.Random(f"retrieval:{self.seed}:{step}")
        length = rng.choice(self.lengths)
        bos = self.fmt.tokenizer.bos_token_id
        rows, weights = [], []
        for _ in range(max(1, self.tokens // length)):
            draw = rng.random()
            if draw < self.digit_fraction:
                ids, w = digit_row(self.digits, length, rng, bos)
            elif draw < self.digit_fraction + self.lm_fraction:
                start = rng.randrange(len(self.corpus) - length)
                ids, w = [bos] + self.corpus[start : start + length - 1], [0.0] + [1.0] * (length - 1)
            else:
                ids, w = passkey_row(self.fmt, self.filler, length, rng)
            rows.append(ids)
            weights.append(w)
        return {"input_ids": torch.tensor(rows), "loss_weights": torch.tensor(weights)}


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


def row_lengths(spec: str, context: int) -> list[int]:
    """Parse ``--lengths``; every length must fit the base's own context (no extension here)."""
    lengths = [int(x) for x in spec.split(",") if x.strip()]
    bad = [n for n in lengths if not 48 <= n <= context]
    if not lengths or bad:
        raise SystemExit(f"--lengths: each must be in 48..{context} (the model's max_position_embeddings), got {spec}")
    return lengths


def rate(peak: float, step: int, steps: int, schedule: str) -> float:
    """10 warm-up steps, then ``constant`` or cosine decay to a tenth.

    Why both: the copy circuit forms in a sudden phase change, and on the demo bootstrap it
    formed only at a steady rate (constant 1e-3: 256-token accuracy 0% -> 85% between steps
    300 and 1000; cosine decay in every phase: under 10% after 1900 steps). Once it has formed,
    a constant rate leaves the accuracy wandering (68-92% over 500 steps) and a short cosine
    phase settles it.
    """
    import math

    if step < 10:
        return peak * (step + 1) / 10
    if schedule == "constant":
        return peak
    progress = (step - 10) / max(1, steps - 10)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def check(model: Any, fmt: passkey.PasskeyFormat, filler: list[int], length: int, trials: int) -> float:
    """Passkey accuracy at ``length`` on evaluation keys, depths and held-out filler."""
    rounds = -(-trials // len(passkey.EVAL_DEPTHS))
    # seed 1: evaluation keys and depths, but not the very prompts context_bench scores (seed 0)
    samples = passkey.eval_samples(fmt, filler, length, passkey.EVAL_DEPTHS, rounds, seed=1)
    model.eval()
    hits = sum(sum(passkey.greedy_hits(model, samples[i : i + 8])) for i in range(0, len(samples), 8))
    model.train()
    return hits / len(samples)


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
