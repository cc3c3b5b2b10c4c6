"""tokenizer_ext.script_leak: scripts of letters, the leaking ids, the mass against a plain loop."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tokenizer_ext import script_leak

VOCAB = ["<eos>", "قال", "said", "сказал", "،", "123", "ق a", "说"]


def word_tokenizer() -> Any:
    """A whitespace word-level tokenizer over ``VOCAB`` (id = position), <eos> special."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def test_letter_script() -> None:
    assert script_leak.letter_script("ب") == "ARABIC"
    assert script_leak.letter_script("a") == "LATIN"
    assert script_leak.letter_script("ж") == "CYRILLIC"
    assert script_leak.letter_script("说") == "CJK"
    assert [script_leak.letter_script(c) for c in "1 ،."] == [None] * 4


def test_text_scripts_drop_a_rare_script() -> None:
    """A script under 1% of the letters (a stray Latin name) is not the text's script."""
    texts = ["قال " * 100 + "x", "ذهب"]
    assert script_leak.text_scripts(texts) == {"ARABIC"}
    assert script_leak.text_scripts(texts, min_share=0.0) == {"ARABIC", "LATIN"}
    with pytest.raises(ValueError, match="no letters"):
        script_leak.text_scripts(["123 ،"])


def test_leak_mask() -> None:
    """Other-script words leak, a mixed piece leaks, punctuation, digits, <eos> and padding rows do not."""
    mask = script_leak.leak_mask(word_tokenizer(), len(VOCAB) + 2, {"ARABIC"})
    assert mask.tolist() == [False, False, True, True, False, False, True, True, False, False]


class Bigram(torch.nn.Module):
    """Logits of the next token from a fixed table row per current token."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None) -> Any:
        return SimpleNamespace(logits=self.table[input_ids])

    def get_output_embeddings(self) -> Any:
        return SimpleNamespace(weight=self.table)


def test_script_leak_against_a_loop() -> None:
    """Mean and 90th percentile of the other-script mass equal a float64 loop over positions."""
    torch.manual_seed(0)
    tok = word_tokenizer()
    table = torch.randn(len(VOCAB), len(VOCAB)) * 2
    texts = ["قال ، قال سكت قال", "قال 123 قال ،", "قال"]  # an unknown word is <eos>; one token: skipped
    got = script_leak.script_leak(Bigram(table), tok, texts, max_length=16)
    leak = {2, 3, 6, 7}
    masses = []
    for text in texts:
        ids = tok(text).input_ids
        for cur in ids[:-1]:
            row = [math.exp(x) for x in table[cur].double().tolist()]
            masses.append(sum(row[j] for j in leak) / sum(row))
    assert got["positions"] == len(masses) == 7
    assert got["mean"] == pytest.approx(sum(masses) / len(masses), rel=1e-5)
    assert got["p90"] == pytest.approx(torch.tensor(masses, dtype=torch.float64).quantile(0.9).item(), rel=1e-5)
