"""Stage ``bootstrap``: train the small default base model, so the pipeline needs no download.

The model is what the workbench exists to adapt: a Llama-architecture model with the
Llama/Mistral 32k SentencePiece tokenizer (mistral-common's ``tokenizer.model.v1``), trained
on the English side of the corpus plus a small Arabic share, like real English-centric bases.
Layer sizes are multiples of 32 because bitsandbytes' 4-bit kernels reject others.

Run alone (CPU, about 7 minutes with the defaults)::

    warsha run recipes/arabic-tiny.yaml --only bootstrap
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warsha.schema import check, ge, gt, le, multiple_of
from warsha.stage import StageContext, StageDef
from warsha.training import TrainParams

DEFAULT_TOKENIZER = "mistral-common:tokenizer.model.v1"


@dataclass
class BootstrapParams:
    """Size, tokenizer and training budget of the default base model."""

    hidden_size: int = field(default=256, metadata=check(ge(32), multiple_of(32)))
    intermediate_size: int = field(default=704, metadata=check(ge(32), multiple_of(32)))
    num_layers: int = field(default=4, metadata=check(ge(1)))
    num_heads: int = field(default=8, metadata=check(ge(1)))
    num_kv_heads: int = field(default=4, metadata=check(ge(1)))
    max_position_embeddings: int = field(default=256, metadata=check(ge(16), help="the trained context"))
    rope_theta: float = field(default=10000.0, metadata=check(gt(0.0)))
    tie_word_embeddings: bool = False
    arabic_share: float = field(default=0.01, metadata=check(ge(0.0), le(0.5), help="share of Arabic training tokens"))
    copy_fraction: float = field(
        default=0.0,
        metadata=check(ge(0.0), le(0.9), help="share of rows that repeat a text span (grows copy/induction heads)"),
    )
    max_train_tokens: int = field(default=4_000_000, metadata=check(ge(1000)))
    eval_documents: int = field(default=300, metadata=check(ge(1)))
    tokenizer: str = field(default=DEFAULT_TOKENIZER, metadata=check(help="'mistral-common:<file>' or a .model path"))
    train: TrainParams = field(
        default_factory=lambda: TrainParams(steps=400, batch_size=8, seq_len=256, lr=2e-3, warmup_steps=30)
    )

    def validate(self) -> list[str]:
        """Shape and tokenizer checks that would otherwise fail minutes into the run."""
        problems = []
        if self.hidden_size % self.num_heads:
            problems.append(f"num_heads: must divide hidden_size {self.hidden_size}, got {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            problems.append(f"num_kv_heads: must divide num_heads {self.num_heads}, got {self.num_kv_heads}")
        if self.train.seq_len > self.max_position_embeddings:
            problems.append(f"train.seq_len: must be <= max_position_embeddings {self.max_position_embeddings}")
        if self.tokenizer.startswith("mistral-common:"):
            if importlib.util.find_spec("mistral_common") is None:
                problems.append(
                    "tokenizer: mistral-common is not installed; install the demo extra: pip install -e '.[demo]'"
                )
        elif not Path(self.tokenizer).is_file():
            problems.append(f"tokenizer: no such SentencePiece model file {self.tokenizer!r}")
        return problems


def tokenizer_file(spec: str) -> Path:
    """The SentencePiece model a ``tokenizer`` parameter names, read from the installed package."""
    if spec.startswith("mistral-common:"):
        name = spec.partition(":")[2]
        return Path(str(importlib.resources.files("mistral_common").joinpath("data", name)))
    return Path(spec)


def build_model(p: BootstrapParams, tokenizer: Any) -> Any:
    """A randomly initialised ``LlamaForCausalLM`` of the configured size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        max_position_embeddings=p.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": p.rope_theta},
        tie_word_embeddings=p.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
    )
    return LlamaForCausalLM(cfg).to(torch.float32)


def training_stream(ctx: StageContext, p: BootstrapParams, tokenizer: Any) -> Any:
    """English train documents plus ``arabic_share`` of Arabic tokens, shuffled by seed."""
    import torch

    from warsha.training import pack_documents

    corpus = ctx.corpus()
    rng = random.Random(ctx.seed)
    english = corpus.texts(corpus.config.source_lang, "train")
    arabic = corpus.texts(corpus.config.target_lang, "train")
    rng.shuffle(english)
    rng.shuffle(arabic)
    n_en = int(p.max_train_tokens * (1 - p.arabic_share))
    parts = [pack_documents(tokenizer, english, n_en)]
    n_ar = int(len(parts[0]) * p.arabic_share / max(1 - p.arabic_share, 1e-9))
    if n_ar > 0:
        parts.append(pack_documents(tokenizer, arabic, n_ar))
    return torch.cat(parts)


def run(ctx: StageContext, p: BootstrapParams) -> dict[str, Any]:
    """Train, save an HF directory, and report bits per character against a unigram floor."""
    import torch
    from transformers import AutoTokenizer

    from warsha import distributed
    from warsha.sentencepiece_hf import sp_model_to_hf
    from warsha.training import Trainer

    torch.manual_seed(ctx.seed)
    if ctx.is_main:
        sp_model_to_hf(tokenizer_file(p.tokenizer), ctx.out_dir)
    distributed.barrier()
    tokenizer = AutoTokenizer.from_pretrained(ctx.out_dir)
    stream = training_stream(ctx, p, tokenizer)
    ctx.log.info("bootstrap: %d training tokens (%.1f%% Arabic)", len(stream), 100 * p.arabic_share)
    model = build_model(p, tokenizer)
    t = p.train

    batch_fn = BootstrapBatches(stream, t.batch_size, t.seq_len, ctx.seed, p.copy_fraction, tokenizer.bos_token_id)

    t0 = time.perf_counter()
    trainer = Trainer(model, t, ctx, batch_fn, name="bootstrap")
    result = trainer.run()
    train_time = time.perf_counter() - t0
    model = trainer.model
    metrics: dict[str, Any] = {
        "train": result.summary(),
        "train_time_s": train_time,
        "parameters": sum(q.numel() for q in model.parameters()),
        "train_tokens": len(stream),
    }
    metrics.update(evaluate_base(ctx, p, model, tokenizer, stream))
    if ctx.is_main:
        model.generation_config.max_length = p.max_position_embeddings
        model.save_pretrained(ctx.out_dir)
    return metrics


@dataclass
class BootstrapBatches:
    """Corpus windows, ``copy_fraction`` of them replaced by rows that repeat a text span.

    Why repeats in a base model: real bases retrieve from their context because the web repeats
    itself; without copy rows the tiny model never learns it, and the passkey evaluation of the
    context extension would measure nothing. Each batch is a pure function of (step, micro,
    rank), so a resumed run sees the same data.
    """

    stream: Any
    batch_size: int
    seq_len: int
    seed: int
    copy_fraction: float
    bos: int | None

    def __call__(self, step: int, micro: int, rank: int) -> dict[str, Any]:
        import torch

        from warsha.synthetic import repeat_row
        from warsha.training import random_windows

        rows = random_windows(self.stream, self.batch_size, self.seq_len, self.seed, step, micro, rank)
        if not self.copy_fraction:
            return {"input_ids": rows}
        rng = random.Random(f"bootstrap:{self.seed}:{step}:{micro}:{rank}")
        weights = torch.ones(rows.shape)
        for i in range(self.batch_size):
            if rng.random() < self.copy_fraction:
                ids, w = repeat_row(rows[i].tolist(), self.seq_len, rng, self.bos)
                rows[i], weights[i] = torch.tensor(ids), torch.tensor(w)
        return {"input_ids": rows, "loss_weights": weights}


def evaluate_base(ctx: StageContext, p: BootstrapParams, model: Any, tokenizer: Any, stream: Any) -> dict[str, Any]:
    """Held-out English and Arabic bits per character, the unigram floor, and a sample."""
    import torch

    from warsha.evaluate import likelihood, unigram_bits_per_char

    corpus = ctx.corpus()
    model.eval()
    out: dict[str, Any] = {"normalisation": corpus.normalisation}
    for lang in (corpus.config.source_lang, corpus.config.target_lang):
        texts = corpus.texts(lang, "validation")[: p.eval_documents]
        lk = likelihood(model, tokenizer, texts, p.max_position_embeddings, desc=f"eval {lang}")
        out[lang] = lk.as_dict()
        out[lang]["unigram_bits_per_char"] = unigram_bits_per_char([stream.tolist()], texts, tokenizer)
    prompt = "Narrated Abu Huraira: The Prophet said,"
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        gen = model.generate(**ids, max_new_tokens=40, max_length=None, do_sample=False)
    out["sample"] = tokenizer.decode(gen[0], skip_special_tokens=True)
    return out


def widths(p: BootstrapParams, _input: Any) -> Any:
    """The built model's widths, from the parameters (planning-time, see ``warsha.widths``)."""
    from warsha.widths import from_sizes

    return from_sizes("llama", p, "bootstrap params")


STAGE = StageDef(
    name="bootstrap",
    params=BootstrapParams,
    entry="warsha.bootstrap:run",
    description="train the small default Llama base model on the corpus (no download)",
    inputs=(),
    training=True,
    widths="warsha.bootstrap:widths",
)
