"""Step-0 quality of initialisations of the new rows: bits/char against the base, no training.

Reads a recipe's run directory (its ``import``, ``extend`` and ``embed`` artifacts), writes each
candidate's rows into the extended model in turn and scores it on the other-domain sets and the
held-out corpus, paired against the base (``warsha.evaluate.ratio_change``). Prints a table and
writes JSON to ``benchmarks/results/``.

    .venv/bin/python -m benchmarks.init_probe runs/arabic-gemma3-270m --docs 6 \\
        --inits mean,first,last,mix0.5,normmean,scale0.8,scale0.6
    .venv/bin/python -m benchmarks.init_probe runs/arabic-gemma3-270m --docs 6 \\
        --inits mean,fitted,chain,mean/chain,fitted/chain

Candidates: ``mean`` (subword mean), ``first`` / ``last`` (a piece's first / last subword row),
``mixA`` (A * first + (1 - A) * mean), ``normmean`` (the mean rescaled to its pieces' mean norm),
``scaleS`` (S * mean: ``tokenizer_ext.embed``'s ``init_scale``), ``fitted`` (the rows the
``embed`` artifact holds, e.g. from its ``fit_map``), ``chain`` (the first subword's row plus
``c_p u``: ``c_p`` is the base's log-probability of the rest of the piece after its first
subword, read after BOS, and ``u`` a direction on which the base's final hidden states are
about 1, fitted by least squares on 16 training documents of the corpus, so the row scores a piece as its first
subword's logit plus ``c_p``, the chain rule with a context-free completion).

The rows are written into the input embedding, which is also the head of a tied model (Gemma 3):
that is what a plain name measures. ``IN/OUT`` (``mean/chain``) unties the head: the input rows
of ``IN``, the output rows of ``OUT``.
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


@torch.no_grad()
def completion_logprobs(model: Any, sources: list[list[int]], bos: int, batch: int = 512) -> torch.Tensor:
    """[n]: for each piece, log P(s_2 .. s_k | BOS s_1) under ``model`` (0 for one-subword pieces).

    Pieces are batched by length with right padding; only the positions that predict a later
    subword go through the head (a 262k-row head at every padded position would cost more than
    the model)."""
    out = torch.zeros(len(sources), dtype=torch.float64)
    head = model.get_output_embeddings().weight
    multi = sorted((i for i, s in enumerate(sources) if len(s) > 1), key=lambda i: len(sources[i]))
    for b in range(0, len(multi), batch):
        idx = multi[b : b + batch]
        width = len(sources[idx[-1]]) + 1
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            ids[r, : len(sources[i]) + 1] = torch.tensor([bos, *sources[i]])
            mask[r, : len(sources[i]) + 1] = 1
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        rows, cols, targets, owner = [], [], [], []
        for r, i in enumerate(idx):  # position k holds s_k (BOS at 0) and predicts s_{k+1}
            for k in range(1, len(sources[i])):
                rows.append(r), cols.append(k), targets.append(sources[i][k]), owner.append(i)
        logp = torch.log_softmax((hidden[rows, cols] @ head.T).double(), -1)
        out.index_add_(0, torch.tensor(owner), logp[torch.arange(len(targets)), torch.tensor(targets)])
    return out.float()


@torch.no_grad()
def constant_direction(model: Any, tok: Any, texts: list[str], max_length: int) -> torch.Tensor:
    """[d]: the least-squares u with h . u = 1 over the final hidden states h of ``texts``."""
    hidden = []
    for text in texts:
        ids = tok(text, return_tensors="pt", truncation=True, max_length=max_length).input_ids
        hidden.append(model.model(input_ids=ids).last_hidden_state[0, 1:].double())
    h = torch.cat(hidden)
    return torch.linalg.lstsq(h, torch.ones(len(h), 1, dtype=torch.float64)).solution[:, 0].float()


def candidate_rows(name: str, base: torch.Tensor, sources: list[list[int]], extra: dict[str, Any]) -> torch.Tensor:
    """The new rows of one candidate from the base rows and each piece's subword ids; ``extra``
    holds what ``fitted`` and ``chain`` need (``main`` fills it)."""
    mean = torch.stack([base[s].mean(0) for s in sources])
    if name == "mean":
        return mean
    if name == "fitted":
        return extra["fitted"]
    if name == "chain":
        return candidate_rows("first", base, sources, extra) + extra["completion"][:, None] * extra["u"][None]
    if name in ("first", "last"):
        return torch.stack([base[s[0] if name == "first" else s[-1]] for s in sources])
    if name.startswith("mix"):
        a = float(name[3:])
        return a * candidate_rows("first", base, sources, extra) + (1 - a) * mean
    if name == "normmean":
        norms = torch.stack([base[s].norm(dim=1).mean() for s in sources])
        return mean * (norms / mean.norm(dim=1)).unsqueeze(1)
    if name.startswith("scale"):
        return mean * float(name[5:])
    raise ValueError(
        f"--inits: unknown candidate {name!r} (mean, first, last, mixA, normmean, scaleS, fitted, chain,"
        " or IN/OUT for an untied head)"
    )


def untied(model: Any) -> Any:
    """``model`` with its head its own matrix (a copy of the tied embedding)."""
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.config.tie_word_embeddings = False
    return model


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
    fitted = AutoModelForCausalLM.from_pretrained(ext_dir, dtype=torch.float32)
    base_rows = fitted.get_input_embeddings().weight[:base_n].clone()
    extra: dict[str, Any] = {"fitted": fitted.get_input_embeddings().weight[base_n : base_n + len(sources)].clone()}
    if any("chain" in name for name in names):
        extra["completion"] = completion_logprobs(base, sources, base_tok.bos_token_id)
        train = corpus.texts(corpus.config.target_lang, "train")[:16]
        extra["u"] = constant_direction(base, base_tok, train, args.max_length)
    results: dict[str, Any] = {}
    for name in names:
        model = AutoModelForCausalLM.from_pretrained(ext_dir, dtype=torch.float32)
        rows_in, _, rows_out = name.partition("/")
        if rows_out:
            untied(model).get_output_embeddings().weight[base_n : base_n + len(sources)] = candidate_rows(
                rows_out, base_rows, sources, extra
            )
        model.get_input_embeddings().weight[base_n : base_n + len(sources)] = candidate_rows(
            rows_in, base_rows, sources, extra
        )
        nll = quality.document_nll(model, ext_tok, sets, args.max_length)
        results[name] = {s: dict(zip(("change", "se"), ratio_change(nll[s], ref[s]))) for s in sets}
    print(f"| init | {' | '.join(sets)} |")
    print(f"|---|{'---|' * len(sets)}")
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{v['change']:+.1%} ({v['se']:.1%})" for v in row.values()) + " |")
    write_results("init_probe", {"run": str(args.run), "docs": args.docs, "results": results})


if __name__ == "__main__":
    main()
