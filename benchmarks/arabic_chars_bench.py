"""Generated Arabic characters per second in `serve`: the extended+adapted model against its base.

Extending the vocabulary is an efficiency step: the same Arabic text takes fewer tokens, so at a
similar cost per decode step the served model writes more characters per second. This script
measures that where it is delivered, in Warsha's engine: both models served in one process,
taking turns prompt by prompt, batch 1, greedy, stopping at EOS (what a user gets), on the same held-out Arabic
prompts (each model's own tokenizer encodes the same opening words). Reported per model: decode
tokens/s, generated characters and Arabic letters per token, Arabic letters per second, and the
ratio extended / base (issue 23's target: >= 1.3x), and how many tokens the tokenizer itself
would spend on the generated text per token the model generated (a model that has not learnt
its new pieces spells words in old, shorter ones).

    .venv/bin/python benchmarks/arabic_chars_bench.py \\
        --base runs/arabic-gemma3-270m/import --extended runs/arabic-gemma3-270m/adapt

Writes `benchmarks/results/arabic_chars_bench.json`. Never run in CI (it needs the real recipe's
artifacts, `make demo-real`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
ARABIC_LETTER = re.compile(r"[\u0621-\u064A]")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help="the unextended model directory (HF)")
    p.add_argument("--extended", type=Path, required=True, help="the extended and adapted model directory (HF)")
    p.add_argument("--prompts", type=int, default=16, help="held-out Arabic documents used as prompts")
    p.add_argument("--prompt-words", type=int, default=12, help="opening words of each document")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--threads", type=int, default=None, help="default: the runtime's rule (physical cores)")
    p.add_argument("--out", type=Path, default=RESULTS / "arabic_chars_bench.json")
    return p.parse_args()


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
        self.params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        self.engine.generate(self.prompts[:1], self.params)  # warm-up
        self.tokens = self.chars = self.letters = self.canonical = 0
        self.seconds = 0.0

    def run(self, i: int) -> None:
        """Generate for prompt ``i`` (batch 1, greedy, to EOS or the limit) and count it."""
        start = time.perf_counter()
        out = self.engine.generate([self.prompts[i]], self.params)[0]
        self.seconds += time.perf_counter() - start
        text = self.tok.decode(out.token_ids, skip_special_tokens=True)
        self.tokens += len(out.token_ids)
        self.chars += len(text)
        self.letters += len(ARABIC_LETTER.findall(text))
        self.canonical += len(self.tok(text, add_special_tokens=False).input_ids)

    def summary(self) -> dict[str, Any]:
        """Tokens/s, characters and Arabic letters per token, Arabic letters/s."""
        return {
            "model_dir": str(self.model_dir),
            "vocab_size": len(self.tok),
            "prompt_tokens_mean": sum(map(len, self.prompts)) / len(self.prompts),
            "generated_tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens / self.seconds,
            "chars_per_token": self.chars / max(self.tokens, 1),
            "arabic_letters_per_token": self.letters / max(self.tokens, 1),
            "arabic_letters_per_s": self.letters / self.seconds,
            # the tokenizer's own encoding of the generated text, per generated token: below 1 the
            # model spells words with more (shorter) pieces than the tokenizer would
            "canonical_tokens_per_generated": self.canonical / max(self.tokens, 1),
        }


def serve_in_turns(models: dict[str, Served], n: int) -> None:
    """Each prompt through every model, the order alternating (ABBA): a shared host's speed
    drifts, and models timed one after the other would carry the drift into their ratio."""
    names = list(models)
    for i in range(n):
        for name in names if i % 2 == 0 else names[::-1]:
            models[name].run(i)


def table(res: dict[str, Any]) -> str:
    rows = [
        "| model | vocab | prompt tokens | generated tokens | tokens/s | chars/token | Arabic letters/token"
        " | Arabic letters/s | re-encoded / generated tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("base", "extended"):
        r = res[name]
        rows.append(
            f"| {name} | {r['vocab_size']} | {r['prompt_tokens_mean']:.1f} | {r['generated_tokens']} |"
            f" {r['tokens_per_s']:.1f} | {r['chars_per_token']:.2f} | {r['arabic_letters_per_token']:.2f} |"
            f" {r['arabic_letters_per_s']:.1f} | {r['canonical_tokens_per_generated']:.3f} |"
        )
    rows.append(f"\nArabic letters per second, extended / base: **{res['ratio']:.2f}x**")
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
    res: dict[str, Any] = {
        "prompts": len(texts),
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
    }
    models = {"base": Served(args.base, texts, args), "extended": Served(args.extended, texts, args)}
    serve_in_turns(models, len(texts))
    for name, model in models.items():
        res[name] = model.summary()
        print(f"{name}: {res[name]['arabic_letters_per_s']:.1f} Arabic letters/s", flush=True)
    res["ratio"] = res["extended"]["arabic_letters_per_s"] / res["base"]["arabic_letters_per_s"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(table(res))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
