"""Byte-level BPE family: tekken conversion and vocab + merges extension."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from tests.tokenizer_ext.conftest import MISTRAL, make_ctx
from tokenizer_ext import byte_bpe, extend
from tokenizer_ext.stages import ExtendParams

TEKKEN = Path(str(MISTRAL / "tekken_240718.json"))


def test_tekken_conversion_matches_tiktoken(corpus: Any) -> None:
    """The converted HF tokenizer gives tiktoken's ids (shifted by the 1,000 specials)."""
    import tiktoken
    from tokenizers import Tokenizer

    data = json.loads(TEKKEN.read_text())
    ranks = {base64.b64decode(e["token_bytes"]): e["rank"] for e in data["vocab"] if e["rank"] < 8000}
    ref = tiktoken.Encoding("tekken-8k", pat_str=data["config"]["pattern"], mergeable_ranks=ranks, special_tokens={})
    tok = Tokenizer.from_str(json.dumps(byte_bpe.tiktoken_to_hf(TEKKEN, max_tokens=8000)))
    texts = corpus.texts("ar", "train")[:150] + corpus.texts("en", "train")[:150] + ["  spaces\n\nand 12345 «»"]
    for text in texts:
        assert tok.encode(text, add_special_tokens=False).ids == [i + 1000 for i in ref.encode(text)]


def test_bpe_split_applies_lowest_rank_first() -> None:
    ranks = {("a", "b"): 1, ("b", "c"): 0, ("a", "bc"): 2}
    assert byte_bpe.bpe_split("abc", ranks) == ["abc"]
    assert byte_bpe.bpe_split("abd", ranks) == ["ab", "d"]
    assert byte_bpe.to_bytes(byte_bpe.to_unicode(bytes(range(256)))) == bytes(range(256))


@pytest.fixture(scope="module")
def extended(tmp_path_factory: pytest.TempPathFactory, tekken_small_dir: Path, corpus: Any) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("extend_byte")
    ctx = make_ctx(tmp, tekken_small_dir, corpus, "extend")
    return ctx.out_dir, extend.run(ctx, ExtendParams(vocab_size=9000 + 2000, max_train_chars=300_000))


def test_byte_level_extension(extended: tuple[Path, dict], tekken_small_dir: Path) -> None:
    out, m = extended
    assert m["family"] == "byte_level" and m["base_vocab_size"] == 9000
    base = json.loads((tekken_small_dir / "tokenizer.json").read_text())
    ext = json.loads((out / "tokenizer.json").read_text())
    base_vocab, ext_vocab = base["model"]["vocab"], ext["model"]["vocab"]
    assert all(ext_vocab[t] == i for t, i in base_vocab.items())
    new = {t: i for t, i in ext_vocab.items() if t not in base_vocab}
    assert len(new) == m["added_pieces"] > 500 and min(new.values()) == 9000
    assert sorted(new.values()) == list(range(9000, 9000 + len(new)))
    n_base = len(base["model"]["merges"])
    assert [tuple(x) for x in ext["model"]["merges"][:n_base]] == [tuple(x) for x in base["model"]["merges"]]
    assert len(ext["model"]["merges"]) == n_base + len(new)
    assert [t["content"] for t in ext["added_tokens"]] == [t["content"] for t in base["added_tokens"]]


def test_byte_level_checks(extended: tuple[Path, dict]) -> None:
    _, m = extended
    assert m["round_trip"]["ar"]["failures"] == 0 and m["round_trip"]["en"]["failures"] == 0
    assert m["unreachable_added"] == 0
    assert m["en_unchanged"]["different"] == 0
    assert m["fertility"]["ar"]["after"]["tokens_per_word"] < 0.7 * m["fertility"]["ar"]["before"]["tokens_per_word"]


def test_each_new_token_is_its_own_encoding(extended: tuple[Path, dict]) -> None:
    """Independent check with the tokenizers library: a new token's bytes encode to itself."""
    from tokenizers import Tokenizer

    out, _ = extended
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    checked = 0
    for token, i in vocab.items():
        if i < 9000:
            continue
        raw = byte_bpe.to_bytes(token)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a partial character cannot be typed as text on its own
        assert tok.encode(text, add_special_tokens=False).ids == [i], token
        checked += 1
    assert checked > 500
