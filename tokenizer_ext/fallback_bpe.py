"""Byte-fallback BPE family (Gemma, Llama-2 style ``tokenizer.json``): extend by continued BPE.

These tokenizers are SentencePiece BPE models converted to HF ``tokenizers``: spaces become
``▁`` in the normaliser, characters outside the vocabulary fall back to ``<0xXX>`` byte tokens,
and merges are applied by rank. New tokens come from :mod:`tokenizer_ext.continued_bpe`
(merges learned on top of the base's own segmentation of target-language words), appended with
ids after every existing id and ranks after every existing merge.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tokenizer_ext import byte_bpe, continued_bpe

BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def is_fallback_bpe(spec: dict[str, Any]) -> bool:
    """A BPE ``tokenizer.json`` with byte fallback and no ByteLevel pre-tokenizer."""
    model = spec.get("model") or {}
    return (
        model.get("type") == "BPE"
        and bool(model.get("byte_fallback"))
        and "ByteLevel" not in json.dumps(spec.get("pre_tokenizer"))
    )


def _tokenizer(spec: dict[str, Any]) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(json.dumps(spec))


def normaliser(spec: dict[str, Any]) -> Callable[[str], str]:
    """The base's normaliser as a function (identity when it has none)."""
    norm = _tokenizer(spec).normalizer
    return (lambda s: s) if norm is None else norm.normalize_str


def segmenter(spec: dict[str, Any]) -> Callable[[list[str]], list[list[str]]]:
    """Each normalised word as the base BPE model (merges and byte fallback) splits it."""
    model = _tokenizer(spec).model
    return lambda words: [[t.value for t in model.tokenize(w)] for w in words]


def token_names(spec: dict[str, Any]) -> set[str]:
    """Every token string the base already has (model vocabulary and added tokens)."""
    return set(spec["model"]["vocab"]) | {t["content"] for t in spec.get("added_tokens", [])}


@dataclass
class FallbackExtension:
    """The extended tokenizer.json and what went into it."""

    spec: dict[str, Any]
    added: list[str]
    last_pair_count: int


def extend(
    spec: dict[str, Any], texts: Iterable[str], n_added: int, script: Callable[[str], bool] | None, min_count: int = 2
) -> FallbackExtension:
    """Learn up to ``n_added`` merges on ``texts`` and append them (ids and ranks) to ``spec``."""
    names = token_names(spec)

    def keep(token: str) -> bool:
        return not BYTE_TOKEN.search(token) and (script is None or script(token))

    words = continued_bpe.word_counts(texts, normaliser(spec), keep)
    learned = continued_bpe.learn(words, segmenter(spec), n_added, keep, names.__contains__, min_count)
    out = json.loads(json.dumps(spec))
    vocab = out["model"]["vocab"]
    next_id = 1 + max([*vocab.values(), *(t["id"] for t in out.get("added_tokens", []))])
    for i, token in enumerate(learned.tokens):
        vocab[token] = next_id + i
    out["model"]["merges"] = [list(m) for m in byte_bpe.merge_list(spec)] + [list(m) for m in learned.merges]
    return FallbackExtension(out, learned.tokens, learned.min_count)
