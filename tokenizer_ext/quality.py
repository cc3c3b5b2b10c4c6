"""Quality and speed measurements shared by ``embed`` and ``adapt`` (held-out split only).

Bits per character, not perplexity: the base and the extended model cut the same text into
different numbers of tokens, so only a per-character figure compares them.
"""

from __future__ import annotations

import math
import time
from typing import Any

from tokenizer_ext import script_leak as leak
from warsha import domains, evaluate
from warsha.evaluate import likelihood, ratio_change

SPLIT = "validation"


def bits_per_char(
    model: Any, tok: Any, corpus: Any, docs: int, max_length: int, set_eval: bool = True
) -> dict[str, float]:
    """Bits per character on the first ``docs`` held-out documents of each language.

    ``set_eval=False`` leaves module modes to the caller (the Trainer sets them mid-run).
    """
    if set_eval:
        model.eval()
    cfg = corpus.config
    out = {}
    for lang in (cfg.target_lang, cfg.source_lang):
        texts = corpus.texts(lang, SPLIT)[:docs]
        out[lang] = likelihood(model, tok, texts, max_length, batch_size=8, desc=f"bpc {lang}").bits_per_char
    return out


def domain_texts(names: list[str], docs: int, corpus: Any) -> dict[str, list[str]]:
    """The other-domain held-out sets (``warsha.domains``), normalised as the training corpus."""
    return {name: domains.load(name, docs, corpus.config.strip_diacritics) for name in names}


def document_nll(
    model: Any, tok: Any, sets: dict[str, list[str]], max_length: int, set_eval: bool = True
) -> dict[str, list[float]]:
    """Negative log-likelihood (nats) of each document of each set (``warsha.evaluate.document_nll``;
    ``set_eval`` as in ``bits_per_char``)."""
    if set_eval:
        model.eval()
    return {
        name: evaluate.document_nll(model, tok, texts, max_length, desc=f"bpc {name}")[1].tolist()
        for name, texts in sets.items()
    }


def domain_bpc(nll: dict[str, list[float]], sets: dict[str, list[str]]) -> dict[str, float]:
    """Bits per character of each set from its per-document NLLs (nats)."""
    return {name: math.fsum(v) / math.log(2) / max(sum(len(t) for t in sets[name]), 1) for name, v in nll.items()}


def domain_report(
    scores: dict[str, dict[str, list[float]]], sets: dict[str, list[str]], reference: str
) -> dict[str, Any]:
    """Bits per character per model and set, each model's change against ``reference`` with its
    paired standard error over documents (same documents, same characters), and the
    per-document NLLs themselves."""
    chars = {name: sum(len(t) for t in texts) for name, texts in sets.items()}
    bpc = {model: domain_bpc(per_set, sets) for model, per_set in scores.items()}
    change: dict[str, Any] = {}
    for model, per_set in scores.items():
        if model == reference:
            continue
        change[model] = {}
        for name, nll in per_set.items():
            rel, se = ratio_change(nll, scores[reference][name])
            change[model][name] = {"change": rel, "se": se}
    described = {
        name: {
            "lang": domains.DOMAINS[name].lang,
            "source": domains.DOMAINS[name].source,
            "docs": len(t),
            "chars": chars[name],
        }
        for name, t in sets.items()
    }
    return {
        "sets": described,
        "bits_per_char": bpc,
        f"change_vs_{reference}": change,
        "nll_per_document": scores,  # nats; lets a later run pair its models against these
    }


def script_leak(model: Any, tok: Any, corpus: Any, docs: int, max_length: int) -> dict[str, float]:
    """Probability on other-script tokens while reading the first ``docs`` held-out target-language
    documents (``tokenizer_ext.script_leak``): what sampled text turns into foreign fragments."""
    texts = corpus.texts(corpus.config.target_lang, SPLIT)[:docs]
    return leak.script_leak(model, tok, texts, max_length)


def generation_speed(model: Any, tok: Any, prompts: list[str], new_tokens: int) -> dict[str, float]:
    """Characters of generated text per second (greedy, batch 1, bf16 where the model is).

    Tokens per second flatters a tokenizer with short pieces; what a user waits for is text,
    so this counts decoded characters.
    """
    import torch

    model.eval()
    chars, seconds, tokens = 0, 0.0, 0
    if prompts:  # warm-up: the first call pays one-off allocation and dispatch costs
        with torch.inference_mode():
            model.generate(
                **tok(prompts[0], return_tensors="pt"),
                max_new_tokens=2,
                max_length=None,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
    for prompt in prompts:
        enc = tok(prompt, return_tensors="pt")
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=new_tokens,
                max_length=None,  # the saved config's max_length (the model's context) would warn per call
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
        seconds += time.perf_counter() - t0
        new = out[0, enc["input_ids"].shape[1] :]
        tokens += int(new.numel())
        chars += len(tok.decode(new, skip_special_tokens=True))
    return {
        "chars_per_s": chars / max(seconds, 1e-9),
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "chars_per_token": chars / max(tokens, 1),
    }


def prompts(corpus: Any, n: int = 4, words: int = 8) -> list[str]:
    """Short target-language prompts: the first words of held-out documents."""
    texts = corpus.texts(corpus.config.target_lang, SPLIT)[:n]
    return [" ".join(t.split()[:words]) for t in texts]
