"""Where an extended model loses bits against its base: the text cut at the places where both
tokenizations agree (``tokenizer_ext.cross_tok.window``), each span's NLL under both models,
summed by what the extended model predicts there.

Classes: ``base_after_base`` (one base token, after a base token), ``base_after_new`` (one base
token right after a new piece: the new piece as *input*), ``new_after_base`` / ``new_after_new``
(one new piece: the new piece as *output*), ``multi`` (several extended tokens). A loss on
base tokens after base tokens is probability the new rows take where they are wrong; a loss
after a new piece is what the model fails to read from it. Prints a table per set and writes
JSON to ``benchmarks/results/``.

    .venv/bin/python -m benchmarks.loss_spans runs/arabic-gemma3-270m/embed \\
        --base runs/arabic-gemma3-270m/extend --sets ar_msa,ar_quran --docs 8
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.serve_bench import write_results
from tokenizer_ext import cross_tok, quality
from warsha.data import DataConfig, load_corpus


def span_class(ext_ids: list[int], i0: int, i1: int, first_new: int) -> str:
    """The class of the extended tokens ``i0+1..i1`` (see the module docstring)."""
    if i1 - i0 != 1:
        return "multi"
    what = "new" if ext_ids[i1] >= first_new else "base"
    return f"{what}_after_{'new' if ext_ids[i0] >= first_new else 'base'}"


def token_nll(model: Any, ids: list[int]) -> torch.Tensor:
    """NLL of each next token of ``ids`` (position t scores ids[t+1])."""
    logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
    return -logp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def spans(ext: Any, base: Any, w: cross_tok.Window, first_new: int) -> dict[str, list[float]]:
    """Per class: [extended NLL, base NLL, spans] summed over one window."""
    e, b = token_nll(ext, w.ext_ids), token_nll(base, w.base_ids)
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for (i0, j0), (i1, j1) in zip(w.pairs, w.pairs[1:]):
        row = out[span_class(w.ext_ids, i0, i1, first_new)]
        row[0] += float(e[i0:i1].sum())
        row[1] += float(b[j0:j1].sum())
        row[2] += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="an extended artifact (embed or adapt output)")
    ap.add_argument("--base", type=Path, required=True, help="the base model (extend's or import's artifact)")
    ap.add_argument("--sets", default="ar_msa,ar_quran", help="other-domain sets (warsha.domains)")
    ap.add_argument("--docs", type=int, default=8, help="documents per set")
    ap.add_argument("--seq-len", type=int, default=256, help="extended tokens per document window")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    side = json.loads((args.model / "tokenizer_ext.json").read_text())
    first_new = int(side["base_vocab_size"])
    ext_tok = AutoTokenizer.from_pretrained(args.model)
    base_tok = AutoTokenizer.from_pretrained(args.model / "base_tokenizer")
    torch.set_grad_enabled(False)
    ext = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()
    sets = quality.domain_texts(args.sets.split(","), args.docs, load_corpus(DataConfig()))
    results: dict[str, Any] = {}
    for name, texts in sets.items():
        total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
        for text in texts:
            for cls, row in spans(
                ext, base, cross_tok.window(text, ext_tok, base_tok, args.seq_len), first_new
            ).items():
                total[cls] = [a + b for a, b in zip(total[cls], row)]
        base_nats = sum(r[1] for r in total.values())
        results[name] = {
            cls: {"spans": int(n), "ext_nats": e, "base_nats": b, "share_of_base": (e - b) / base_nats}
            for cls, (e, b, n) in sorted(total.items())
        }
        print(f"{name} (base: {base_nats:.0f} nats)")
        print("| span | spans | extended - base, of the base's total |\n|---|---|---|")
        for cls, r in results[name].items():
            print(f"| {cls} | {r['spans']} | {r['share_of_base']:+.1%} |")
    write_results("loss_spans", {"model": str(args.model), "docs": args.docs, "results": results})


if __name__ == "__main__":
    main()
