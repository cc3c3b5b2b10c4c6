"""tokenizer_ext.extend on a SentencePiece BPE base (mistral-common tokenizer.model.v1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.tokenizer_ext.conftest import MISTRAL, make_ctx
from tokenizer_ext import extend, sp_bpe
from tokenizer_ext.stages import ExtendParams


@pytest.fixture(scope="module")
def extended(tmp_path_factory: pytest.TempPathFactory, sp_model_dir: Path, corpus: Any) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("extend_sp")
    ctx = make_ctx(tmp, sp_model_dir, corpus, "extend")
    metrics = extend.run(ctx, ExtendParams(vocab_size=34000, max_train_chars=400_000))
    return ctx.out_dir, metrics


def test_base_ids_and_specials_unchanged(extended: tuple[Path, dict]) -> None:
    out, metrics = extended
    base = sp_bpe.load_proto(Path(str(MISTRAL / "tokenizer.model.v1")))
    merged = sp_bpe.load_proto(out / "tokenizer.model")
    assert [(p.piece, p.type) for p in merged.pieces[: len(base.pieces)]] == [(p.piece, p.type) for p in base.pieces]
    added = merged.pieces[len(base.pieces) :]
    assert len(added) == metrics["added_pieces"] > 1000
    assert all(p.type == sp_bpe.NORMAL for p in added)  # normal pieces, never special/user-defined
    assert len({p.piece for p in merged.pieces}) == len(merged.pieces)
    spec = merged.trainer_spec
    assert (spec.unk_id, spec.bos_id, spec.eos_id) == (0, 1, 2)


def test_every_added_piece_has_a_merge_path(extended: tuple[Path, dict]) -> None:
    merged = sp_bpe.load_proto(extended[0] / "tokenizer.model")
    vocab = {p.piece for p in merged.pieces}
    for p in merged.pieces[32000:]:
        if len(p.piece) > 1:
            assert any(p.piece[:k] in vocab and p.piece[k:] in vocab for k in range(1, len(p.piece))), p.piece


def test_autotokenizer_and_sentencepiece_agree(extended: tuple[Path, dict], corpus: Any) -> None:
    import sentencepiece as spm
    from transformers import AutoTokenizer

    out, _ = extended
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.is_fast and len(tok) == sp.get_piece_size()
    texts = corpus.texts("ar", "validation") + corpus.texts("en", "validation")
    assert tok(texts, add_special_tokens=False)["input_ids"] == sp.encode(texts)
    assert tok(texts[0])["input_ids"][0] == sp.bos_id()


def test_checks_in_metrics(extended: tuple[Path, dict]) -> None:
    _, m = extended
    assert m["round_trip"]["ar"]["failures"] == 0 and m["round_trip"]["en"]["failures"] == 0
    assert m["round_trip"]["ar"]["texts"] > 10
    assert m["sentencepiece_round_trip"]["failures"] == 0
    assert m["hf_matches_sentencepiece"]["different"] == 0
    assert m["unreachable_added"] == 0
    assert m["en_unchanged"]["different"] == 0
    fert = m["fertility"]
    assert fert["ar"]["before"]["tokens_per_word"] > 4.0
    assert fert["ar"]["after"]["tokens_per_word"] < 0.5 * fert["ar"]["before"]["tokens_per_word"]
    assert fert["en"]["tokens_per_word_change"] == 0.0
    assert m["pair_token_ratio"]["after"] < m["pair_token_ratio"]["before"]
    assert m["vocab_size"] <= 34000


def test_independent_unreachable_count(extended: tuple[Path, dict], corpus: Any) -> None:
    """Brute force: each added piece is produced by its own text (no dummy prefix) or held-out text."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    out, _ = extended
    proto = pb.ModelProto()
    proto.ParseFromString((out / "tokenizer.model").read_bytes())
    full = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    proto.normalizer_spec.add_dummy_prefix = False
    bare = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    seen = {i for ids in full.encode(corpus.texts("ar", "validation")) for i in ids}
    dead = [
        i
        for i in range(32000, full.get_piece_size())
        if i not in seen and i not in bare.encode(full.id_to_piece(i).replace("\u2581", " "))
    ]
    assert dead == []


def test_merged_model_follows_target_model(extended: tuple[Path, dict], corpus: Any) -> None:
    """The rescoring makes Arabic segment almost as the standalone target model would."""
    import sentencepiece as spm

    out, m = extended
    base = sp_bpe.load_proto(Path(str(MISTRAL / "tokenizer.model.v1")))
    texts = extend.sample_texts(corpus.texts("ar", "train"), 400_000, 0)
    target = sp_bpe.processor(sp_bpe.train_bpe(texts, 34000 - 32000, base))
    merged = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    held = corpus.texts("ar", "validation")
    n_target = sum(map(len, target.encode(held)))
    n_merged = sum(map(len, merged.encode(held)))
    assert n_merged <= 1.05 * n_target


def test_sample_texts_caps_characters() -> None:
    texts = [f"doc {i} " * 10 for i in range(100)]
    sample = extend.sample_texts(texts, 500, seed=1)
    assert 0 < sum(map(len, sample)) <= 500
    assert sample == extend.sample_texts(texts, 500, seed=1)
    assert extend.sample_texts(texts, 0, seed=1) == texts
