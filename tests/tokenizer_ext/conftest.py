"""Fixtures: the installed corpus (small cap), tiny random Llama models with real tokenizers.

Nothing is downloaded: the base tokenizer comes from mistral-common's package data and the
models are built from a config in-process.
"""

from __future__ import annotations

import importlib.resources
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from warsha.data import Corpus, DataConfig, load_corpus
from warsha.stage import StageContext

MISTRAL = importlib.resources.files("mistral_common") / "data"


class ListTracker:
    """Keeps what a stage logs, so tests can check it."""

    def __init__(self) -> None:
        self.rows: list[tuple[dict[str, Any], int | None]] = []

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.rows.append((metrics, step))


def tiny_llama(out: Path, vocab: int, tie: bool = False, seed: int = 0) -> Any:
    """A 2-layer random Llama whose linear sizes are multiples of 64 (bitsandbytes-friendly)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    return model


def with_model(extended: Path, out: Path, tie: bool) -> Path:
    """A copy of an ``extend`` artifact at ``out`` whose model is a fresh ``tiny_llama``."""
    shutil.copytree(extended, out)
    for f in ("model.safetensors", "config.json"):
        (out / f).unlink()
    tiny_llama(out, 32000, tie=tie)
    return out


@pytest.fixture(scope="session")
def corpus() -> Corpus:
    return load_corpus(DataConfig(max_documents=2500))


@pytest.fixture(scope="session")
def sp_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama with mistral-common's 32k SentencePiece BPE (tokenizer.model.v1)."""
    from warsha.sentencepiece_hf import sp_model_to_hf

    out = tmp_path_factory.mktemp("sp_base")
    tiny_llama(out, 32000)
    sp_model_to_hf(Path(str(MISTRAL / "tokenizer.model.v1")), out)
    return out


@pytest.fixture(scope="session")
def tekken_small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama with the first 8,000 ranks of tekken as an HF byte-level tokenizer.json."""
    from tokenizer_ext import byte_bpe

    out = tmp_path_factory.mktemp("tekken_base")
    spec = byte_bpe.tiktoken_to_hf(Path(str(MISTRAL / "tekken_240718.json")), max_tokens=8000)
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    byte_bpe.write_tekken_side_files(out)
    tiny_llama(out, 1000 + 8000)
    return out


def make_ctx(tmp: Path, model_dir: Path, corpus: Corpus, name: str = "stage", **inputs: Path) -> StageContext:
    """A StageContext as the pipeline would build it, over a preloaded corpus."""
    recipe = SimpleNamespace(data=corpus.config, seed=0)
    out = tmp / f"{name}.out"
    return StageContext(
        stage=f"tokenizer_ext.{name}",
        stage_id=name,
        recipe=recipe,
        out_dir=out,
        inputs={"model": model_dir, **inputs},
        input_manifests={},
        checkpoint_dir=tmp / f"{name}.ckpt",
        tracker=ListTracker(),
        device="cpu",
        seed=0,
        _corpus=corpus,
    )


@pytest.fixture(scope="session")
def sp_extended_dir(tmp_path_factory: pytest.TempPathFactory, sp_model_dir: Path, corpus: Corpus) -> Path:
    """``extend`` output over the tiny SentencePiece model: about 1,000 added pieces."""
    from tokenizer_ext import extend
    from tokenizer_ext.stages import ExtendParams

    tmp = tmp_path_factory.mktemp("sp_extended")
    ctx = make_ctx(tmp, sp_model_dir, corpus, "extend")
    extend.run(ctx, ExtendParams(vocab_size=33000, max_train_chars=200_000, check_docs=8))
    return ctx.out_dir


@pytest.fixture(scope="session")
def sp_embedded_dir(tmp_path_factory: pytest.TempPathFactory, sp_extended_dir: Path, corpus: Corpus) -> Path:
    """``embed`` output (subword mean, padded to 64) over ``sp_extended_dir``."""
    from tokenizer_ext import embed
    from tokenizer_ext.stages import EmbedParams

    tmp = tmp_path_factory.mktemp("sp_embedded")
    ctx = make_ctx(tmp, sp_extended_dir, corpus, "embed")
    embed.run(ctx, EmbedParams(eval_docs=0, domain_eval=[]))
    return ctx.out_dir


@pytest.fixture(scope="session")
def trained_base(tmp_path_factory: pytest.TempPathFactory, sp_extended_dir: Path, corpus: Any) -> Path:
    """``extend``'s output with a base that has learnt something (a random one predicts nearly
    uniformly, which leaves a fit nothing to match): 80 steps on the corpus, base tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from warsha.training import pack_documents, random_windows

    out = tmp_path_factory.mktemp("trained_base") / "extend.out"
    shutil.copytree(sp_extended_dir, out)
    side = json.loads((out / "tokenizer_ext.json").read_text())
    (out / "tokenizer_ext.json").write_text(json.dumps({**side, "base_model": str(out)}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    stream = pack_documents(AutoTokenizer.from_pretrained(out / "base_tokenizer"), corpus.texts("ar", "train")[:300])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(80):
        ids = random_windows(stream, 8, 64, 0, step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tokenizers(sp_extended_dir: Path) -> tuple[Any, Any]:
    """The extended tokenizer and the base one it carries, of ``sp_extended_dir``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(sp_extended_dir), AutoTokenizer.from_pretrained(
        sp_extended_dir / "base_tokenizer"
    )
