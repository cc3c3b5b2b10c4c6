"""Script leak: the probability a model gives to tokens of another writing system while it reads
target-language text.

Why it is measured: bits per character can look fine while a model spreads a few percent of its
mass over words of other languages (an extended, adapted Gemma put Cyrillic and Latin words
beside the Arabic it was reading). Teacher-forced the cost is small, but sampled text compounds
it: one drawn Russian word makes the next one likely, and the reader gets fragments of other
languages. The figure is deterministic (no sampling) and costs one forward per held-out document.

A token "leaks" when its text has a letter whose script (the first word of the letter's Unicode
name: ARABIC, LATIN, CYRILLIC, CJK, ...) is not among the scripts of the target-language text
itself. Special tokens (end of text, turn markers) never leak.
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

MIN_SCRIPT_SHARE = 0.01  # a script below this share of the target text's letters is noise in it


def letter_script(ch: str) -> str | None:
    """The script of a letter (first word of its Unicode name), or None for a non-letter."""
    if not unicodedata.category(ch).startswith("L"):
        return None
    name = unicodedata.name(ch, "")
    return name.split(" ", 1)[0] if name else None


def text_scripts(texts: Iterable[str], min_share: float = MIN_SCRIPT_SHARE) -> set[str]:
    """The scripts that write ``texts``: each at least ``min_share`` of their letters."""
    counts = Counter(s for t in texts for s in map(letter_script, t) if s)
    total = sum(counts.values())
    if not total:
        raise ValueError("script_leak: the target-language texts have no letters")
    return {s for s, n in counts.items() if n / total >= min_share}


def leak_mask(tok: Any, vocab_size: int, scripts: set[str]) -> Any:
    """Boolean [vocab_size]: ids whose decoded text has a letter outside ``scripts``.

    Decoding each id (rather than reading its raw piece) sees the text a byte-level tokenizer
    would emit; ids beyond the tokenizer (padding rows of the embedding) never leak.
    """
    import torch

    special = set(tok.all_special_ids)
    n = min(vocab_size, len(tok))
    texts = tok.batch_decode([[i] for i in range(n)])
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    for i, text in enumerate(texts):
        if i not in special and any(s is not None and s not in scripts for s in map(letter_script, text)):
            mask[i] = True
    return mask


def script_leak(model: Any, tok: Any, texts: Sequence[str], max_length: int) -> dict[str, float]:
    """Mean probability per position on other-script tokens, over ``texts`` (teacher-forced).

    Each document is one scoring forward (``warsha.score_forward.rows_probability``: the head a
    vocabulary slice at a time, bf16 where the CPU is fast at it), never its whole softmax.
    Returns the mean, the 90th percentile over positions and the number of positions scored.
    """
    import torch

    from warsha.score_forward import rows_probability

    head = model.get_output_embeddings() or model.get_input_embeddings()
    device = head.weight.device
    mask = leak_mask(tok, head.weight.shape[0], text_scripts(texts)).to(device)
    per_position = []
    model.eval()
    with torch.inference_mode():
        for text in texts:
            ids = tok(text, return_tensors="pt", truncation=True, max_length=max_length).input_ids.to(device)
            if ids.shape[1] >= 2:
                per_position.append(rows_probability(model, ids, mask).cpu())
    if not per_position:
        raise ValueError("script_leak: no held-out document has two tokens")
    p = torch.cat(per_position).double()
    return {"mean": float(p.mean()), "p90": float(p.quantile(0.9)), "positions": int(p.numel())}
