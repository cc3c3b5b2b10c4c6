"""Bad input fails early with a ValueError that names the field or file and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.tokenizer_ext.conftest import make_ctx
from tokenizer_ext import adapt, extend
from tokenizer_ext.stages import AdaptParams, ExtendParams
from warsha.data import Corpus, DataConfig
from warsha.schema import from_dict


def test_corpus_without_target_language(tmp_path: Path, sp_model_dir: Path) -> None:
    english = [(f"d{i}", f"plain english document number {i}") for i in range(50)]
    corpus = Corpus(docs={"ar": english, "en": english}, pairs=[], config=DataConfig(), normalisation="nfc")
    ctx = make_ctx(tmp_path, sp_model_dir, corpus, "extend")
    with pytest.raises(ValueError, match="no 'ar' text"):
        extend.run(ctx, ExtendParams())
    assert not ctx.out_dir.exists()


def test_vocab_smaller_than_base(tmp_path: Path, sp_model_dir: Path, corpus: Any) -> None:
    ctx = make_ctx(tmp_path, sp_model_dir, corpus, "extend")
    with pytest.raises(ValueError, match=r"vocab_size: 30000 is not larger than the base tokenizer's 32000"):
        extend.run(ctx, ExtendParams(vocab_size=30000))


def test_unigram_sentencepiece_is_unsupported(tmp_path: Path, corpus: Any) -> None:
    import sentencepiece as spm

    model = tmp_path / "uni"
    model.mkdir()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus.texts("en", "train")[:300]),
        model_prefix=str(model / "tokenizer"),
        model_type="unigram",
        vocab_size=300,
        minloglevel=2,
    )
    ctx = make_ctx(tmp_path, model, corpus, "extend")
    with pytest.raises(ValueError, match="Unigram model is not supported; supported families are SentencePiece BPE"):
        extend.run(ctx, ExtendParams())


def test_wordpiece_json_is_unsupported(tmp_path: Path, corpus: Any) -> None:
    from tokenizers import Tokenizer, models

    model = tmp_path / "wp"
    model.mkdir()
    Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(model / "tokenizer.json"))
    ctx = make_ctx(tmp_path, model, corpus, "extend")
    with pytest.raises(ValueError, match="WordPiece tokenizer is not supported; supported families: SentencePiece BPE"):
        extend.run(ctx, ExtendParams())


def test_no_tokenizer_at_all(tmp_path: Path, corpus: Any) -> None:
    ctx = make_ctx(tmp_path, tmp_path, corpus, "extend")
    with pytest.raises(ValueError, match="no tokenizer.model or tokenizer.json"):
        extend.run(ctx, ExtendParams())


def test_qlora_rejects_rows_bitsandbytes_cannot_run(tmp_path: Path, sp_embedded_dir: Path, corpus: Any) -> None:
    src = tmp_path / "unpadded"
    shutil.copytree(sp_embedded_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["vocab_size"] -= 5
    (src / "config.json").write_text(json.dumps(cfg))
    ctx = make_ctx(tmp_path, src, corpus, "adapt")
    with pytest.raises(ValueError, match="not a multiple of 32.*pad_to_multiple_of: 64"):
        adapt.run(ctx, AdaptParams(compare_base=False))


def test_missing_deepspeed_config(tmp_path: Path, sp_embedded_dir: Path, corpus: Any) -> None:
    ctx = make_ctx(tmp_path, sp_embedded_dir, corpus, "adapt")
    with pytest.raises(ValueError, match="deepspeed: no such config 'nope.json'"):
        adapt.run(ctx, AdaptParams(mode="full", deepspeed="nope.json", compare_base=False))


def test_adapt_params_cross_checks() -> None:
    problems: list[str] = []
    from_dict(AdaptParams, {"mode": "qlora", "deepspeed": "recipes/deepspeed/zero2.json"}, "stages[3].params", problems)
    assert problems == ["stages[3].params.deepspeed: QLoRA runs without DeepSpeed here; use mode full or embeddings"]
    problems = []
    from_dict(AdaptParams, {"mode": "full", "offload_optimizer": True, "train": {"steps": -1}}, "p", problems)
    assert problems == ["p.train.steps: must be >= 0, got -1"]
    problems = []
    from_dict(ExtendParams, {"vocab_size": "big", "script": "auto"}, "p", problems)
    assert problems == ["p.vocab_size: expected int, got str 'big'"]


def test_stages_module_imports_no_heavy_libraries() -> None:
    import subprocess
    import sys

    code = (
        "import sys, tokenizer_ext.stages as s;"
        " print(sorted(s.STAGES), 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "['adapt', 'embed', 'extend'] False False"
