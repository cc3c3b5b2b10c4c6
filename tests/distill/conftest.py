"""Tiny in-process fixtures: a ~500-piece BPE tokenizer trained on corpus text, a 4-layer
hidden-64 Llama target trained for a few seconds (so that its distributions are peaked, as a
real target's are), and a StageContext over a few hundred corpus documents."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

VOCAB = 500
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0}


@pytest.fixture(scope="session", autouse=True)
def one_thread() -> Any:
    """Tiny batch-1 models are overhead-bound: on this shared 2-core machine a second intra-op
    thread made each forward 5-40x slower (synchronisation under contention)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _data_config() -> Any:
    from warsha.data import DataConfig

    return DataConfig(source="hadith", collections=["bukhari"], max_documents=400)


@pytest.fixture(scope="session")
def corpus() -> Any:
    from warsha.data import load_corpus

    return load_corpus(_data_config())


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, corpus: Any) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    texts = corpus.texts("ar", "train")[:200] + corpus.texts("en", "train")[:200]
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    out = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(out)
    return out


def tiny_config(vocab: int, layers: int = 4, hidden: int = 64) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters=dict(YARN),
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="session")
def make_config() -> Any:
    """``tiny_config`` as a fixture (test modules cannot import a conftest by name)."""
    return tiny_config


def _quick_train(model: Any, tokenizer: Any, texts: list[str], steps: int, seed: int) -> None:
    ids = [tokenizer.bos_token_id] + [t for d in tokenizer(texts)["input_ids"] for t in d]
    stream = torch.tensor(ids)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - 65, (8,), generator=gen)
        batch = torch.stack([stream[s : s + 64] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, corpus: Any) -> Path:
    """A trained tiny target saved as an HF directory with its tokenizer."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(len(tok)))
    texts = corpus.texts("ar", "train")[:150] + corpus.texts("en", "train")[:150]
    _quick_train(model, tok, texts, steps=80, seed=0)
    out = tmp_path_factory.mktemp("target")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def target(target_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(target_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


def make_ctx(tmp_path: Path, model_dir: Path, corpus: Any = None) -> Any:
    """A StageContext as the pipeline would build it, with a no-op tracker."""
    from warsha.config import Recipe
    from warsha.stage import StageContext
    from warsha.tracking import Tracker

    recipe = Recipe(name="test", data=_data_config())
    out = tmp_path / "out"
    out.mkdir(parents=True)
    return StageContext(
        stage="distill.draft",
        stage_id="draft",
        recipe=recipe,
        out_dir=out,
        inputs={"model": model_dir},
        input_manifests={"model": None},
        checkpoint_dir=tmp_path / "ckpt",
        tracker=Tracker(),
        device="cpu",
        seed=0,
        log=logging.getLogger("test"),
        _corpus=corpus,
    )


@pytest.fixture
def ctx_factory(target_dir: Path, corpus: Any) -> Any:
    """``ctx_factory(path)``: a fresh StageContext rooted at ``path`` over the tiny target."""
    return lambda path: make_ctx(path, target_dir, corpus)
