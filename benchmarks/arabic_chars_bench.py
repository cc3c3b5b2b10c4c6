"""Generated Arabic characters per second in `serve`: the extended+adapted model against its base.

Extending the vocabulary is an efficiency step: the same Arabic text takes fewer tokens, so at a
similar cost per decode step the served model writes more characters per second. This script
measures that where it is delivered, in Warsha's engine: both models served in one process,
taking turns prompt by prompt, batch 1, stopping at EOS (what a user gets), on the same held-out
Arabic prompts (each model's own tokenizer encodes the same opening words). Reported per model
and decoding mode: decode tokens/s, generated characters and Arabic letters per token, Arabic
letters per second, the ratio extended / base (issue 23's target: >= 1.3x) with a bootstrap
interval over prompts beside the ratio of letters per token (the part of it that timing noise
on a shared machine cannot move), the share of letters written in other scripts (a model whose
adaptation weakened its sense of the language drifts into Latin or Cyrillic words when it
samples), and how many tokens the tokenizer itself would spend on the generated text per token
the model generated (a model that has not learnt its new pieces spells words in old, shorter
ones). The JSON keeps every generated text.

Two decoding modes by default, because they measure different things: sampling at the
OpenAI API's defaults (temperature 1, top_p 1, seeded per prompt), which draws from each model's
own distribution and is what a client gets unless it asks otherwise; and greedy, where a base
model's text settles into a loop within a few dozen tokens, so its letters per token are those
of whatever phrase it happens to repeat.

    .venv/bin/python -m benchmarks.arabic_chars_bench \\
        --base runs/arabic-gemma3-270m/import --extended runs/arabic-gemma3-270m/adapt

Writes `benchmarks/results/arabic_chars_bench.json`. Never run in CI (it needs the real recipe's
artifacts, `make demo-real`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from tokenizer_ext.letter_rate import (
    Counts,
    bootstrap_interval,
    letters_per_s_ratio,
    letters_per_token_ratio,
    mode_name,
    parse_temperatures,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help="the unextended model directory (HF)")
    p.add_argument("--extended", type=Path, required=True, help="the extended and adapted model directory (HF)")
    p.add_argument("--prompts", type=int, default=32, help="held-out Arabic documents used as prompts")
    p.add_argument("--prompt-words", type=int, default=12, help="opening words of each document")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument(
        "--temperatures",
        default="1,0",
        help="comma list of decoding modes to run, each a temperature (0 = greedy; others sample with top_p 1)",
    )
    p.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i in both models")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--threads", type=int, default=None, help="default: the runtime's rule (physical cores)")
    p.add_argument("--out", type=Path, default=RESULTS / "arabic_chars_bench.json")
    args = p.parse_args()
    try:
        args.temperatures = parse_temperatures(args.temperatures)
    except ValueError as exc:
        p.error(str(exc))
    return args


def prompt_texts(n: int, words: int) -> list[str]:
    """The opening ``words`` words of the first ``n`` long-enough held-out Arabic documents."""
    from warsha.data import DataConfig, load_corpus

    corpus = load_corpus(DataConfig(strip_diacritics=True, validation_fraction=0.02, test_fraction=0.02))
    texts = [t for t in corpus.texts("ar", "validation") if len(t.split()) > 2 * words]
    if len(texts) < n:
        raise SystemExit(f"--prompts: only {len(texts)} held-out Arabic documents have {2 * words} words")
    return [" ".join(t.split()[:words]) for t in texts[:n]]


class Served:
    """One model in the engine with its tokenizer, its prompts and what it has generated."""

    def __init__(self, model_dir: Path, texts: list[str], args: argparse.Namespace) -> None:
        from transformers import AutoTokenizer

        from serve.engine import LLM
        from serve.sampler import SamplingParams

        self.model_dir, self.tok = model_dir, AutoTokenizer.from_pretrained(model_dir)
        bos = [self.tok.bos_token_id] if self.tok.bos_token_id is not None else []
        self.prompts = [bos + ids for ids in self.tok(texts, add_special_tokens=False).input_ids]
        self.engine = LLM(model_dir, dtype=args.dtype, max_num_seqs=1)
        self.max_tokens, self.seed = args.max_tokens, args.seed
        self.engine.generate(self.prompts[:1], SamplingParams(temperature=0.0, max_tokens=args.max_tokens))  # warm-up
        self.counts = {t: Counts() for t in args.temperatures}

    def run(self, i: int, temperature: float) -> None:
        """Generate for prompt ``i`` (batch 1, to EOS or the limit) and count it."""
        from serve.sampler import SamplingParams

        seed = None if temperature == 0 else self.seed + i
        params = SamplingParams(temperature=temperature, top_p=1.0, max_tokens=self.max_tokens, seed=seed)
        start = time.perf_counter()
        out = self.engine.generate([self.prompts[i]], params)[0]
        seconds = time.perf_counter() - start
        text = self.tok.decode(out.token_ids, skip_special_tokens=True)
        canonical = len(self.tok(text, add_special_tokens=False).input_ids)
        self.counts[temperature].add(text, len(out.token_ids), canonical, seconds)


def serve_in_turns(models: dict[str, Served], n: int, temperatures: list[float]) -> None:
    """Each prompt through every model, the order alternating (ABBA): a shared host's speed
    drifts, and models timed one after the other would carry the drift into their ratio."""
    names = list(models)
    turn = 0
    for i in range(n):
        for temperature in temperatures:
            for name in names if turn % 2 == 0 else names[::-1]:
                models[name].run(i, temperature)
            turn += 1


def table(res: dict[str, Any]) -> str:
    rows = [
        "| mode | model | vocab | generated tokens | tokens/s | chars/token | Arabic letters/token"
        " | Arabic letters/s | other-script letters | re-encoded / generated tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in res["modes"].items():
        for name in ("base", "extended"):
            m = r[name]
            rows.append(
                f"| {mode} | {name} | {res['vocab_size'][name]} | {m['generated_tokens']} |"
                f" {m['tokens_per_s']:.1f} | {m['chars_per_token']:.2f} | {m['arabic_letters_per_token']:.2f} |"
                f" {m['arabic_letters_per_s']:.1f} | {m['other_script_letter_share']:.1%} |"
                f" {m['canonical_tokens_per_generated']:.3f} |"
            )
    rows.append("")
    for mode, r in res["modes"].items():
        lo, hi = r["ratio_interval_90"]
        ratio = f"**{r['ratio']:.2f}x** (90%: {lo:.2f}-{hi:.2f})"
        per_token = f"letters/token {r['letters_per_token_ratio']:.2f}x"
        rows.append(f"Arabic letters per second, extended / base, {mode}: {ratio}; {per_token}")
    return "\n".join(rows)


def main() -> None:
    from warsha import runtime

    runtime.apply(reexec=True)  # allocator and threads before the first tensor
    args = parse_args()
    for flag, path in (("--base", args.base), ("--extended", args.extended)):
        if not (path / "config.json").is_file():
            raise SystemExit(f"{flag}: no config.json in {path}; run `make demo-real` first")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    texts = prompt_texts(args.prompts, args.prompt_words)
    models = {"base": Served(args.base, texts, args), "extended": Served(args.extended, texts, args)}
    serve_in_turns(models, len(texts), args.temperatures)
    res: dict[str, Any] = {
        "prompts": len(texts),
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "seed": args.seed,
        "model_dir": {name: str(m.model_dir) for name, m in models.items()},
        "vocab_size": {name: len(m.tok) for name, m in models.items()},
        "modes": {},
    }
    for t in args.temperatures:
        ext, base = models["extended"].counts[t], models["base"].counts[t]
        res["modes"][mode_name(t)] = {
            "temperature": t,
            "base": base.summary(),
            "extended": ext.summary(),
            "ratio": letters_per_s_ratio(ext, base, list(range(len(texts)))),
            "letters_per_token_ratio": letters_per_token_ratio(ext, base),
            "ratio_interval_90": bootstrap_interval(ext, base),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=2))
    tmp.replace(args.out)
    print(table(res))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
