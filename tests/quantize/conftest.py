"""Fixtures of the quantize tests; the helpers live in quant_fixtures.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.quantize.quant_fixtures import FakeContext, make_tokenizer, synthetic_docs, tiny_model


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """Tiny matrices: one thread is faster, and two threads on a shared 2-core machine made
    these tests 40x slower (oversubscription). Restored afterwards for other packages' tests."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny model with its tokenizer."""
    path = tmp_path_factory.mktemp("tiny_llama")
    tok = make_tokenizer(path)
    tiny_model(vocab=len(tok)).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def corpus() -> Any:
    """A two-language corpus with train/validation splits decided by id hash."""
    from warsha.data import Corpus, DataConfig

    docs = {
        lang: [(f"{lang}:{i}", t) for i, t in enumerate(synthetic_docs(lang, 400, 7 + k))]
        for k, lang in enumerate(("ar", "en"))
    }
    cfg = DataConfig(validation_fraction=0.1, test_fraction=0.05)
    return Corpus(docs=docs, pairs=[], config=cfg, normalisation="nfc+whitespace")


@pytest.fixture
def make_ctx(model_dir: Path, corpus: Any, tmp_path: Path) -> Any:
    def make(src: Path | None = None, name: str = "out") -> FakeContext:
        return FakeContext(model_dir=src or model_dir, out_dir=tmp_path / name, the_corpus=corpus)

    return make
