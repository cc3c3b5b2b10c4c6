"""The SentencePiece -> HF fast tokenizer converter gives sentencepiece's exact ids."""

from __future__ import annotations

from pathlib import Path

import sentencepiece as spm

from warsha.bootstrap import DEFAULT_TOKENIZER, tokenizer_file
from warsha.data import DataConfig, load_corpus
from warsha.sentencepiece_hf import sp_model_to_hf

EDGE_CASES = ["", " ", "  x", "a\nb  c", "tab\there", "🙂 emoji", "ＡＢＣ", "1234567", "\u0600\u06ff", "end "]


def test_ids_and_decoding_match_sentencepiece(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model_file = tokenizer_file(DEFAULT_TOKENIZER)
    sp_model_to_hf(model_file, tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    corpus = load_corpus(DataConfig(collections=["muslim"], max_documents=400, strip_diacritics=False))
    texts = corpus.texts("ar", "train")[:300] + corpus.texts("en", "train")[:300] + EDGE_CASES
    ours = tok(texts, add_special_tokens=False).input_ids
    theirs = [sp.encode(t) for t in texts]
    mismatched = [t for t, a, b in zip(texts, ours, theirs) if a != b]
    assert mismatched == []
    assert [tok.decode(ids) for ids in ours] == [sp.decode(ids) for ids in theirs]
    assert tok("hi").input_ids[0] == sp.bos_id() == tok.bos_token_id
    assert tok.eos_token_id == sp.eos_id() and len(tok) == sp.get_piece_size()
