"""What serve's int8-activation int4 kernel costs in quality: teacher-forced decode perplexity.

serve's default int4 path on CPU rounds each decode row's activations to int8 per 32 features
(`serve/KERNELS.md`). On random benchmark models that moves logits visibly, which says little
about a trained model. This script scores held-out test documents of the corpus one token per
forward (so every step runs the batch-1 decode kernels, never the prefill path), side by side in
one process, for:

- the int4 checkpoint with int8 activations (serve's default),
- the same checkpoint with float32 activations,
- the unquantized model it was made from (bf16, serve's own kernels).

    .venv/bin/python -m benchmarks.int4_decode_ppl --int4 runs/arabic-tiny/gptq --reference runs/arabic-tiny/yarn

Prints perplexity per language and the int8/float ratio; writes
benchmarks/results/int4_decode_ppl-<time>.json. A few minutes on the demo model.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from serve.decode_score import decode_nll
from serve.model import DecoderModel
from serve.tokenizer import Tokenizer
from warsha.data import DataConfig, load_corpus

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    from warsha import runtime

    runtime.apply(reexec=True)  # allocator and threads before the first tensor
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--int4", type=Path, required=True, help="GPTQ-format checkpoint (a quantize stage's output)")
    p.add_argument("--reference", type=Path, required=True, help="the unquantized model it was made from")
    p.add_argument("--langs", default="ar,en")
    p.add_argument("--documents", type=int, default=12, help="test documents per language")
    p.add_argument("--max-tokens", type=int, default=192, help="tokens scored per document")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    for d in (args.int4, args.reference):
        if not (d / "config.json").is_file():
            p.error(f"{d} has no config.json: pass a model directory")
    torch.set_num_threads(args.threads)
    corpus = load_corpus(
        DataConfig(source="hadith", strip_diacritics=True, validation_fraction=0.02, test_fraction=0.02)
    )
    tok = Tokenizer(args.int4)
    models = {
        "int4_int8_activations": DecoderModel.load(args.int4, int4_activations="int8"),
        "int4_float_activations": DecoderModel.load(args.int4, int4_activations="float"),
        "unquantized_bf16": DecoderModel.load(args.reference),
    }
    report: dict[str, dict[str, float]] = {}
    for lang in args.langs.split(","):
        seqs = [tok.encode(t)[: args.max_tokens] for t in corpus.texts(lang, "test")[: args.documents]]
        n = sum(len(s) - 1 for s in seqs)
        report[lang] = {name: math.exp(sum(decode_nll(m, s) for s in seqs) / n) for name, m in models.items()}
        report[lang]["tokens"] = n
    print(f"{'lang':5} {'int4 int8-act':>14} {'int4 float-act':>15} {'unquantized':>12} {'int8/float':>11}")
    for lang, r in report.items():
        ratio = r["int4_int8_activations"] / r["int4_float_activations"]
        print(
            f"{lang:5} {r['int4_int8_activations']:14.3f} {r['int4_float_activations']:15.3f} "
            f"{r['unquantized_bf16']:12.3f} {ratio:11.4f}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"int4_decode_ppl-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(
        json.dumps({"int4": str(args.int4), "reference": str(args.reference), "perplexity": report}, indent=2)
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
