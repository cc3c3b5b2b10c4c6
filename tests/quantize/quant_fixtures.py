"""Helpers for the quantize tests (a uniquely named module, so that tests can import it
without clashing with other packages' conftest.py): tiny random Llama models (some with outlier
input channels), a tiny BPE tokenizer trained in-process, a synthetic two-language corpus and a
minimal stage context."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

AR_LETTERS = "ابتثجحخدذرزسشصضطظعغفقكلمنهوي"
EN_WORDS = (
    "the prophet said that whoever prays at night and gives charity will be rewarded by god on the day of"
    " judgement narrated from his father about fasting water bread house city journey"
).split()


def synthetic_docs(lang: str, n: int, seed: int) -> list[str]:
    """Pseudo-text with word reuse (so BPE has something to learn) and varied lengths."""
    rng = random.Random(seed)
    if lang == "ar":
        vocab = ["".join(rng.choice(AR_LETTERS) for _ in range(rng.randint(2, 6))) for _ in range(120)]
    else:
        vocab = list(EN_WORDS)
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(3, 80))) for _ in range(n)]


def make_tokenizer(out_dir: Path) -> Any:
    """A byte-level BPE (about 600 pieces) with BOS/EOS, saved next to the model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<s>", "</s>", "<unk>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(synthetic_docs("ar", 300, 1) + synthetic_docs("en", 300, 2), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out_dir)
    return fast


def tiny_config(
    vocab: int = 640,
    kv_heads: int = 4,
    hidden: int = 128,
    inter: int = 256,
    model_type: str = "llama",
    tied: bool = False,
) -> Any:
    """2 decoder layers; hidden/intermediate divisible by 32 and 64."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        model_type,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=1,
    )


def tiny_model(seed: int = 0, outliers: bool = True, **kw: Any) -> Any:
    """A random model whose norms give a few input channels 20x larger activations, as real
    LLMs have; without that structure AWQ has nothing to find and a quality test means little."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(**kw), dtype=torch.float32).eval()
    if outliers:
        with torch.no_grad():
            for layer in model.model.layers:
                # Gemma's norms multiply by (1 + w) and start at w = 0: give them the same outliers
                pre_mlp = getattr(layer, "pre_feedforward_layernorm", layer.post_attention_layernorm)
                for norm in (layer.input_layernorm, pre_mlp):
                    if model.config.model_type == "gemma3_text":
                        norm.weight[:4] = 19.0
                    else:
                        norm.weight[:4] *= 20
    return model


@dataclass
class FakeContext:
    """The parts of ``warsha.stage.StageContext`` a quantize stage uses."""

    model_dir: Path
    out_dir: Path
    the_corpus: Any
    device: str = "cpu"
    seed: int = 0
    is_main: bool = True
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("warsha"))

    def corpus(self) -> Any:
        return self.the_corpus
