"""Step-0 quality of initialisations of the new rows: bits/char against the base, no training.

Reads a recipe's run directory (its ``import``, ``extend`` and ``embed`` artifacts), writes each
candidate's rows into the extended model in turn and scores it on the other-domain sets and the
held-out corpus, paired against the base (``warsha.evaluate.ratio_change``). Prints a table and
writes JSON to ``benchmarks/results/``.

    .venv/bin/python -m benchmarks.init_probe runs/arabic-gemma3-270m --docs 6 \\
        --inits mean,first,last,mix0.5,normmean,scale0.8,scale0.6

Candidates: ``mean`` (subword mean), ``first`` / ``last`` (a piece's first / last subword row),
``mixA`` (A * first + (1 - A) * mean), ``normmean`` (the mean rescaled to its pieces' mean norm),
``scaleS`` (S * mean: ``tokenizer_ext.embed``'s ``init_scale``). The rows are written into the
input embedding, which is also the head of a tied model (Gemma 3): that is what this measures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.serve_bench import write_results
from tokenizer_ext import embed, quality
from warsha.data import DataConfig, load_corpus
from warsha.domains import DOMAINS
from warsha.evaluate import ratio_change


def candidate_rows(name: str, base: torch.Tensor, sources: list[list[int]]) -> torch.Tensor:
    """The new rows of one candidate from the base rows and each piece's subword ids."""
    mean = torch.stack([base[s].mean(0) for s in sources])
    if name == "mean":
        return mean
    if name in ("first", "last"):
        return torch.stack([base[s[0] if name == "first" else s[-1]] for s in sources])
    if name.startswith("mix"):
        a = float(name[3:])
        return a * candidate_rows("first", base, sources) + (1 - a) * mean
    if name == "normmean":
        norms = torch.stack([base[s].norm(dim=1).mean() for s in sources])
        return mean * (norms / mean.norm(dim=1)).unsqueeze(1)
    if name.startswith("scale"):
        return mean * float(name[5:])
    raise ValueError(f"--inits: unknown candidate {name!r} (mean, first, last, mixA, normmean, scaleS)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a recipe's run directory with import, extend and embed")
    ap.add_argument("--docs", type=int, default=6, help="documents per set")
    ap.add_argument("--inits", default="mean,scale0.8,scale0.6", help="comma-separated candidates")
    ap.add_argument("--max-length", type=int, default=256)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = args.inits.split(",")
    ext_dir = args.run / "embed"
    side = json.loads((ext_dir / "tokenizer_ext.json").read_text())
    base_n = int(side["base_vocab_size"])
    ext_tok = AutoTokenizer.from_pretrained(ext_dir)
    base_tok = AutoTokenizer.from_pretrained(ext_dir / "base_tokenizer")
    sources = embed.base_splits(args.run / "extend", base_n, len(ext_tok))
    corpus = load_corpus(DataConfig())
    sets = quality.domain_texts(list(DOMAINS), args.docs, corpus)
    sets["hadith"] = corpus.texts(corpus.config.target_lang, quality.SPLIT)[: args.docs]
    torch.set_grad_enabled(False)
    base = AutoModelForCausalLM.from_pretrained(args.run / "import", dtype=torch.float32)
    ref = quality.document_nll(base, base_tok, sets, args.max_length)
    model = AutoModelForCausalLM.from_pretrained(ext_dir, dtype=torch.float32)
    weight = model.get_input_embeddings().weight
    base_rows = weight[:base_n].clone()
    results: dict[str, Any] = {}
    for name in names:
        weight[base_n : base_n + len(sources)] = candidate_rows(name, base_rows, sources)
        nll = quality.document_nll(model, ext_tok, sets, args.max_length)
        results[name] = {s: dict(zip(("change", "se"), ratio_change(nll[s], ref[s]))) for s in sets}
    print(f"| init | {' | '.join(sets)} |")
    print(f"|---|{'---|' * len(sets)}")
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{v['change']:+.1%} ({v['se']:.1%})" for v in row.values()) + " |")
    write_results("init_probe", {"run": str(args.run), "docs": args.docs, "results": results})


if __name__ == "__main__":
    main()
