"""Which tokenizer family a model directory (or file) holds, and its base vocabulary size.

Dispatch ends in one clear error naming the supported families, before any training starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizer_ext import byte_bpe, fallback_bpe, sp_bpe
from warsha import tokenizer_files

# Besides the tokenizer files (warsha.tokenizer_files), what a new tokenizer's artifact does not inherit.
SKIP_FILES = ("warsha.json", "tokenizer_ext.json")
# Characters whose presence marks a piece as target-language only. The bidi marks U+200E/F
# are included because Arabic web and hadith text is full of them and English never is.
SCRIPTS = {"ar": "[\u0600-\u06ff\u0750-\u077f\u08a0-\u08ff\ufb50-\ufdff\ufe70-\ufeff\u200e\u200f]"}


@dataclass
class BaseTokenizer:
    """A base tokenizer in the form its family edits: a ModelProto or a tokenizer.json dict."""

    family: str  # "sentencepiece" | "byte_level" | "byte_fallback"
    source: Path
    proto: Any = None
    spec: dict[str, Any] | None = None

    @property
    def size(self) -> int:
        """Every id the base uses (specials included): added ids start here."""
        if self.proto is not None:
            return len(self.proto.pieces)
        assert self.spec is not None
        ids = [*self.spec["model"]["vocab"].values(), *(t["id"] for t in self.spec.get("added_tokens", []))]
        return 1 + max(ids)


def load_base(path: Path) -> BaseTokenizer:
    """Open the tokenizer of a model directory, or a tokenizer file, by family."""
    path = Path(path)
    if path.is_dir():
        if (path / "tokenizer.model").is_file():
            return _sentencepiece(path / "tokenizer.model")
        if (path / "tokenizer.json").is_file():
            return _hf_json(path / "tokenizer.json")
        raise ValueError(f"{path}: no tokenizer.model or tokenizer.json; supported families: {byte_bpe.SUPPORTED}")
    if path.suffix == ".json" and byte_bpe.is_tiktoken_json(path):
        return BaseTokenizer("byte_level", path, spec=byte_bpe.tiktoken_to_hf(path))
    if path.suffix == ".json":
        return _hf_json(path)
    return _sentencepiece(path)


def _sentencepiece(path: Path) -> BaseTokenizer:
    try:
        proto = sp_bpe.load_proto(path)
    except Exception as exc:  # protobuf raises DecodeError; anything else is the same problem
        raise ValueError(
            f"{path}: not a SentencePiece model ({exc}); supported families: {byte_bpe.SUPPORTED}"
        ) from exc
    sp_bpe.check_bpe(proto, str(path))
    return BaseTokenizer("sentencepiece", path, proto=proto)


def _hf_json(path: Path) -> BaseTokenizer:
    spec = json.loads(path.read_text())
    if "vocab" in spec and "config" in spec:
        return BaseTokenizer("byte_level", path, spec=byte_bpe.tiktoken_to_hf(path))
    if fallback_bpe.is_fallback_bpe(spec):
        return BaseTokenizer("byte_fallback", path, spec=spec)
    byte_bpe.check_byte_level(spec, str(path))
    return BaseTokenizer("byte_level", path, spec=spec)


PieceTest = Callable[[str], bool]
# What a piece may hold besides letters under ``letters_only``: the word-start markers of
# SentencePiece (``▁``) and byte-level BPE (``Ġ``, or a decoded space).
WORD_START = "\u2581\u0120 "


def script_pattern(script: str, lang: str) -> re.Pattern[str] | None:
    """The target-script test for added pieces: ``auto`` (by language), ``none`` or a regex."""
    if script == "none":
        return None
    if script == "auto":
        return re.compile(SCRIPTS[lang]) if lang in SCRIPTS else None
    return re.compile(script)


def is_word(text: str) -> bool:
    """Letters and combining marks only, after an optional word-start marker: no punctuation,
    digits, bidi marks or symbols glued to the word."""
    body = text.lstrip(WORD_START)
    return bool(body) and all(unicodedata.category(c)[0] in "LM" for c in body)


def piece_test(script: str, lang: str, letters_only: bool) -> PieceTest | None:
    """Which learned pieces may be added (``None``: every one).

    ``script`` as in ``script_pattern``: the piece must hold a target-script character.
    ``letters_only``: it must also be a word or part of one (``is_word``). Corpus pieces such
    as ``▁الله،`` (a name glued to its comma) or bidi-mark runs around punctuation apply almost
    nowhere outside the corpus, yet take a row and probability everywhere; pre-tokenizers of
    byte-level models (GPT-2, Llama 3) keep punctuation apart from letters for the same reason.
    """
    pattern = script_pattern(script, lang)
    if pattern is None and not letters_only:
        return None

    def test(text: str) -> bool:
        return (pattern is None or bool(pattern.search(text))) and (not letters_only or is_word(text))

    return test


def copy_model_files(src: Path, dst: Path) -> None:
    """Carry the model's weights and configs into ``dst`` without the old tokenizer (its chat
    template and generation config do travel: the extended model is still the same chat model).

    Hard links where the filesystem allows (artifacts are immutable, and an 8B checkpoint
    should not be copied just to ship a new tokenizer beside it), copies otherwise.
    """
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name in SKIP_FILES or tokenizer_files.is_tokenizer_file(item.name) or item.is_dir():
            continue
        target = dst / item.name
        try:
            os.link(item, target)
        except OSError:
            shutil.copy2(item, target)


def save_base_tokenizer(src: Path, dst: Path) -> None:
    """Keep the base tokenizer beside the extended one: ``embed`` splits new pieces with it, and
    ``adapt`` formats the base model's chat prompts with it (so its chat setup comes along)."""
    tokenizer_files.copy_tokenizer(src, dst)
