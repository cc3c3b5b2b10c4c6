"""Byte-fallback BPE family (Gemma 3's tokenizer.json): continued-BPE extension and tied embed."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gemma3_tiny import save_tiny_gemma3
from tests.tokenizer_ext.conftest import make_ctx
from tokenizer_ext import continued_bpe, embed, extend, family
from tokenizer_ext.stages import EmbedParams, ExtendParams


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory, corpus: Any) -> Path:
    out = tmp_path_factory.mktemp("gemma_base")
    save_tiny_gemma3(out, corpus.texts("en", "train")[:1500] + corpus.texts("ar", "train")[:30])
    return out


@pytest.fixture(scope="module")
def gemma_extended(tmp_path_factory: pytest.TempPathFactory, gemma_dir: Path, corpus: Any) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("gemma_extend")
    ctx = make_ctx(tmp, gemma_dir, corpus, "extend")
    base = family.load_base(gemma_dir)
    return ctx.out_dir, extend.run(ctx, ExtendParams(vocab_size=base.size + 1500, max_train_chars=300_000))


def test_gemma_tokenizer_is_byte_fallback_family(gemma_dir: Path) -> None:
    base = family.load_base(gemma_dir)
    assert base.family == "byte_fallback"
    from transformers import AutoTokenizer

    assert base.size == len(AutoTokenizer.from_pretrained(gemma_dir))


def test_extension_keeps_ids_round_trips_and_has_no_dead_pieces(
    gemma_extended: tuple[Path, dict], gemma_dir: Path, corpus: Any
) -> None:
    from transformers import AutoTokenizer

    out, m = gemma_extended
    base = json.loads((gemma_dir / "tokenizer.json").read_text())
    ext = json.loads((out / "tokenizer.json").read_text())
    n = family.load_base(gemma_dir).size
    assert m["family"] == "byte_fallback" and m["added_pieces"] == 1500
    assert all(ext["model"]["vocab"][t] == i for t, i in base["model"]["vocab"].items())
    new = sorted(i for t, i in ext["model"]["vocab"].items() if t not in base["model"]["vocab"])
    assert new == list(range(n, n + 1500))
    n_merges = len(base["model"]["merges"])
    assert ext["model"]["merges"][:n_merges] == base["model"]["merges"]
    assert m["round_trip"]["ar"]["failures"] == 0 and m["round_trip"]["en"]["failures"] == 0
    assert m["unreachable_added"] == 0
    assert m["en_unchanged"]["different"] == 0
    fert = m["fertility"]["ar"]
    assert fert["after"]["tokens_per_word"] < 0.7 * fert["before"]["tokens_per_word"]
    # independent check of reachability: every added token encodes its own text as one id
    tok = AutoTokenizer.from_pretrained(out)
    model = tok.backend_tokenizer.model
    for i in range(n, n + 1500):
        assert [t.id for t in model.tokenize(tok.convert_ids_to_tokens(i))] == [i]
    held = corpus.texts("ar", "validation")[:40]
    for text in held:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_continued_bpe_matches_brute_force() -> None:
    """Incremental pair counting gives the merges a recount-from-scratch BPE gives."""
    words = Counter({"abab": 5, "abc": 3, "bcb": 2, "cab": 4})

    def brute(n: int) -> list[tuple[str, str]]:
        seqs = {w: list(w) for w in words}
        out = []
        while len(out) < n:
            counts: Counter[tuple[str, str]] = Counter()
            for w, s in seqs.items():
                for p in zip(s, s[1:]):
                    counts[p] += words[w]
            if not counts:
                break
            best = min(counts, key=lambda p: (-counts[p], p))
            if counts[best] < 2:
                break
            out.append(best)
            for w, s in seqs.items():
                merged, j = [], 0
                while j < len(s):
                    if j + 1 < len(s) and (s[j], s[j + 1]) == best:
                        merged.append(s[j] + s[j + 1])
                        j += 2
                    else:
                        merged.append(s[j])
                        j += 1
                seqs[w] = merged
        return out

    got = continued_bpe.learn(words, lambda ws: [list(w) for w in ws], 6, lambda t: True, lambda t: False)
    assert got.merges == brute(6)


def test_embed_keeps_the_tie(gemma_extended: tuple[Path, dict], tmp_path: Path, corpus: Any) -> None:
    """New rows are written once and shared by input and output (Gemma ties them)."""
    from transformers import AutoModelForCausalLM

    ext_dir, m = gemma_extended
    ctx = make_ctx(tmp_path, ext_dir, corpus, "embed")
    metrics = embed.run(ctx, EmbedParams(eval_docs=0, pad_to_multiple_of=64, domain_eval=[]))
    assert metrics["tied"] is True
    model = AutoModelForCausalLM.from_pretrained(ctx.out_dir, dtype=torch.float32)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert emb.data_ptr() == head.data_ptr() and model.config.tie_word_embeddings
    n = m["base_vocab_size"]
    assert emb.shape[0] == metrics["rows"] and emb.shape[0] % 64 == 0
    base = AutoModelForCausalLM.from_pretrained(ext_dir, dtype=torch.float32).get_input_embeddings().weight
    torch.testing.assert_close(emb[:n], base[:n])
    sources = embed.base_splits(ext_dir, n, n + m["added_pieces"])
    for i in (0, 7, len(sources) - 1):
        torch.testing.assert_close(emb[n + i], base[sources[i]].mean(0))
    # the model scales its embeddings (Gemma multiplies by sqrt(hidden)): the resized module kept its class
    assert type(model.get_input_embeddings()).__name__ == "Gemma3TextScaledWordEmbedding"


def test_letters_only_adds_no_piece_with_punctuation(gemma_dir: Path, tmp_path: Path, corpus: Any) -> None:
    """``letters_only``: no added piece glues punctuation or bidi marks to letters, while the
    same corpus without it does add such pieces (the hadith's ``word،``)."""
    base = family.load_base(gemma_dir)
    glued = {}
    for flag in (False, True):
        ctx = make_ctx(tmp_path / str(flag), gemma_dir, corpus, "extend")
        extend.run(ctx, ExtendParams(vocab_size=base.size + 400, max_train_chars=300_000, letters_only=flag))
        spec = json.loads((ctx.out_dir / "tokenizer.json").read_text())
        added = [t for t, i in spec["model"]["vocab"].items() if i >= base.size]
        glued[flag] = [t for t in added if not family.is_word(t)]
    assert glued[False], "the corpus should produce glued pieces, or this test tests nothing"
    assert glued[True] == []


def test_is_word() -> None:
    assert family.is_word("▁الله") and family.is_word("ال") and family.is_word("Ġword") and family.is_word("بِ")
    for text in ("▁الله،", "\u200f.\u200f", "▁", "", "ب2", "▁a-b"):
        assert not family.is_word(text), text


def test_untie_gives_new_rows_their_own_output(gemma_extended: tuple[Path, dict], tmp_path: Path, corpus: Any) -> None:
    """``untie``: the saved model has a head of its own, equal to the embedding where written
    (base rows and the initialised new rows) and stays untied after a reload."""
    from transformers import AutoModelForCausalLM

    ext_dir, m = gemma_extended
    ctx = make_ctx(tmp_path, ext_dir, corpus, "embed")
    metrics = embed.run(ctx, EmbedParams(eval_docs=0, domain_eval=[], untie=True))
    assert metrics["tied"] is False
    model = AutoModelForCausalLM.from_pretrained(ctx.out_dir, dtype=torch.float32)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert emb.data_ptr() != head.data_ptr() and not model.config.tie_word_embeddings
    torch.testing.assert_close(head, emb)
    with torch.no_grad():
        head[m["base_vocab_size"]] += 1.0
    assert not torch.equal(head[m["base_vocab_size"]], emb[m["base_vocab_size"]])
