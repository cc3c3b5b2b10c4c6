"""Corpus loading, normalisation and splits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from warsha.data import DataConfig, FileSpec, load_corpus, normalise, split_of


def test_normalise_strips_diacritics_and_tatweel_and_spaces() -> None:
    text = "قَالَ  رَسُولُ\u0640 اللَّهِ\n"
    assert normalise(text, strip_diacritics=True) == "قال رسول الله"
    assert normalise(text, strip_diacritics=False) == "قَالَ رَسُولُ\u0640 اللَّهِ"


def test_split_is_deterministic_by_id_and_proportional() -> None:
    ids = [f"bukhari:{i}" for i in range(20000)]
    splits = [split_of(i, 0.05, 0.05) for i in ids]
    assert splits == [split_of(i, 0.05, 0.05) for i in ids]
    for name, expected in (("test", 0.05), ("validation", 0.05), ("train", 0.9)):
        assert abs(splits.count(name) / len(ids) - expected) < 0.01


def test_bundled_corpus_pairs_and_disjoint_splits() -> None:
    corpus = load_corpus(DataConfig(collections=["bukhari", "muslim"]))
    assert len(corpus.pairs) > 10000
    train = {p.id for p in corpus.pairs_in("train")}
    test = {p.id for p in corpus.pairs_in("test")}
    assert train and test and not train & test
    ar = corpus.texts("ar", "test")
    assert ar and not any("\u064e" in t for t in ar), "diacritics must be stripped"
    assert "strip_diacritics" in corpus.normalisation
    assert all("  " not in t for t in corpus.texts("en", "test"))


def test_user_txt_and_jsonl_files(tmp_path: Path) -> None:
    txt = tmp_path / "ar.txt"
    txt.write_text("مرحبا بالعالم\nكيف حالك اليوم\n")
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"ar": f"نص رقم {i}", "en": f"text number {i}"}) for i in range(30)))
    cfg = DataConfig(source="files", files=[FileSpec(str(txt), "ar"), FileSpec(str(jsonl), "ar")])
    corpus = load_corpus(cfg)
    assert len(corpus.pairs) == 30
    assert len(corpus.docs["ar"]) == 32 and len(corpus.docs["en"]) == 30


def test_corpus_without_target_language_text(tmp_path: Path) -> None:
    txt = tmp_path / "en.txt"
    txt.write_text("only english here\nand more english\n")
    cfg = DataConfig(source="files", files=[FileSpec(str(txt), "ar")])
    with pytest.raises(ValueError, match="holds no 'ar' text"):
        load_corpus(cfg)


def test_repeated_texts_are_kept_once_so_no_held_out_text_is_trained_on(tmp_path: Path) -> None:
    jsonl = tmp_path / "pairs.jsonl"
    rows = [{"ar": f"نص رقم {i}", "en": f"text number {i}"} for i in range(200)]
    rows += [{"ar": f"نص رقم {i}", "en": f"another translation {i}"} for i in range(200)]
    rows += [{"ar": f"نص آخر {i}", "en": "Similar to the above."} for i in range(3)]
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    corpus = load_corpus(DataConfig(source="files", files=[FileSpec(str(jsonl), "ar")]))
    assert len(corpus.pairs) == 201
    for lang in ("ar", "en"):
        texts = [t for _, t in corpus.docs[lang]]
        assert len(texts) == len(set(texts))
        train = set(corpus.texts(lang, "train"))
        assert not train & (set(corpus.texts(lang, "test")) | set(corpus.texts(lang, "validation")))


def test_bundled_corpus_has_no_text_in_two_splits() -> None:
    corpus = load_corpus(DataConfig())
    for lang in ("ar", "en"):
        held_out = set(corpus.texts(lang, "test")) | set(corpus.texts(lang, "validation"))
        assert held_out and not held_out & set(corpus.texts(lang, "train"))
