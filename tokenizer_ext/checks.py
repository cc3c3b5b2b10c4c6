"""The extension's built-in checks, written to the stage metrics.

Each check counts failures and shows a few examples instead of asserting, so a manifest says
how far off a bad tokenizer is, not just that it is bad.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from warsha.evaluate import fertility, hf_encoder

EXAMPLES = 3


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[:n] + "..."


def round_trip(tok: Any, texts: Sequence[str]) -> dict[str, Any]:
    """decode(encode(x)) == x over ``texts`` with an HF tokenizer."""
    ids = tok(list(texts), add_special_tokens=False)["input_ids"]
    bad = [(t, tok.decode(x)) for t, x in zip(texts, ids) if tok.decode(x) != t]
    return {
        "texts": len(texts),
        "failures": len(bad),
        "rate": 1.0 - len(bad) / max(len(texts), 1),
        "examples": [{"text": _short(t), "decoded": _short(d)} for t, d in bad[:EXAMPLES]],
    }


def sp_round_trip(sp: Any, texts: Sequence[str]) -> dict[str, Any]:
    """The same check through sentencepiece itself."""
    bad = [(t, sp.decode(x)) for t, x in zip(texts, sp.encode(list(texts))) if sp.decode(x) != t]
    return {
        "texts": len(texts),
        "failures": len(bad),
        "examples": [{"text": _short(t), "decoded": _short(d)} for t, d in bad[:EXAMPLES]],
    }


def same_ids(a: list[list[int]], b: list[list[int]], texts: Sequence[str]) -> dict[str, Any]:
    """How many texts two encoders tokenize differently (with examples)."""
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return {
        "texts": len(texts),
        "different": len(diff),
        "examples": [_short(texts[i]) for i in diff[:EXAMPLES]],
    }


def byte_unreached(tok: Any, first_added: int, held_out: Sequence[str]) -> list[int]:
    """Added ids that neither the BPE model on their own bytes nor any held-out text produces."""
    model = tok.backend_tokenizer.model
    seen: set[int] = set()
    for i in range(first_added, len(tok)):
        if [t.id for t in model.tokenize(tok.convert_ids_to_tokens(i))] == [i]:
            seen.add(i)
    for ids in tok(list(held_out), add_special_tokens=False)["input_ids"]:
        seen.update(ids)
    return [i for i in range(first_added, len(tok)) if i not in seen]


def fertility_report(base: Any, ext: Any, texts: Sequence[str]) -> dict[str, Any]:
    """Tokens per word and characters per token, before and after."""
    before = fertility(hf_encoder(base), texts)
    after = fertility(hf_encoder(ext), texts)
    return {
        "before": before.as_dict(),
        "after": after.as_dict(),
        "tokens_per_word_change": after.tokens_per_word / max(before.tokens_per_word, 1e-12) - 1.0,
    }


def pair_ratio(base: Any, ext: Any, pairs: Sequence[Any]) -> dict[str, float]:
    """Target-language tokens over source-language tokens for the same content."""
    out = {}
    for name, tok in (("before", base), ("after", ext)):
        tgt = sum(len(x) for x in tok([p.target for p in pairs], add_special_tokens=False)["input_ids"])
        src = sum(len(x) for x in tok([p.source for p in pairs], add_special_tokens=False)["input_ids"])
        out[name] = tgt / max(src, 1)
    return out
