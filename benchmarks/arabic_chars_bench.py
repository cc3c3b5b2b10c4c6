"""Generated Arabic characters per second in `serve`: the extended+adapted model against its base.

Extending the vocabulary is an efficiency step: the same Arabic text takes fewer tokens, so at a
similar cost per decode step the served model writes more characters per second. This script
measures that where it is delivered, in Warsha's engine: both models served one after the other
in one process, batch 1, greedy, stopping at EOS (what a user gets), on the same held-out Arabic
prompts (each model's own tokenizer encodes the same opening words). Reported per model: decode
tokens/s, generated characters and Arabic letters per token, Arabic letters per second, and the
ratio extended / base (issue 23's target: >= 1.3x).

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


def serve_model(model_dir: Path, texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Serve ``texts`` one at a time (batch 1) and count what comes out."""
    from transformers import AutoTokenizer

    from serve.engine import LLM
    from serve.sampler import SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    prompts = [bos + ids for ids in tok(texts, add_special_tokens=False).input_ids]
    engine = LLM(model_dir, dtype=args.dtype, max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    engine.generate(prompts[:1], params)  # warm-up
    tokens = chars = letters = 0
    seconds = 0.0
    for prompt in prompts:
        start = time.perf_counter()
        out = engine.generate([prompt], params)[0]
        seconds += time.perf_counter() - start
        text = tok.decode(out.token_ids, skip_special_tokens=True)
        tokens += len(out.token_ids)
        chars += len(text)
        letters += len(ARABIC_LETTER.findall(text))
    return {
        "model_dir": str(model_dir),
        "vocab_size": len(tok),
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
        "generated_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "chars_per_token": chars / max(tokens, 1),
        "arabic_letters_per_token": letters / max(tokens, 1),
        "arabic_letters_per_s": letters / seconds,
    }


def table(res: dict[str, Any]) -> str:
    rows = [
        "| model | vocab | prompt tokens | generated tokens | tokens/s | chars/token | Arabic letters/token"
        " | Arabic letters/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ("base", "extended"):
        r = res[name]
        rows.append(
            f"| {name} | {r['vocab_size']} | {r['prompt_tokens_mean']:.1f} | {r['generated_tokens']} |"
            f" {r['tokens_per_s']:.1f} | {r['chars_per_token']:.2f} | {r['arabic_letters_per_token']:.2f} |"
            f" {r['arabic_letters_per_s']:.1f} |"
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
    for name, path in (("base", args.base), ("extended", args.extended)):
        res[name] = serve_model(path, texts, args)
        print(f"{name}: {res[name]['arabic_letters_per_s']:.1f} Arabic letters/s", flush=True)
    res["ratio"] = res["extended"]["arabic_letters_per_s"] / res["base"]["arabic_letters_per_s"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(table(res))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
