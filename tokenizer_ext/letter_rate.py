"""Arabic letters a served model writes per second and per token, extended against base.

`python -m benchmarks.arabic_chars_bench` serves both models and counts what they generate; the
counting and the ratios are here so that they are tested on counts whose answer is known
(tests/tokenizer_ext/test_letter_rate.py). Arabic letters are U+0621-U+064A; letters of any other
script (Latin, Cyrillic, CJK, ...) are counted apart, through `script_leak.letter_script`.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from tokenizer_ext.script_leak import letter_script

ARABIC_LETTER = re.compile(r"[\u0621-\u064A]")


def other_script_letters(text: str) -> int:
    """Letters of ``text`` written in a script other than Arabic."""
    return sum(1 for ch in text if letter_script(ch) not in (None, "ARABIC"))


def parse_temperatures(text: str) -> list[float]:
    """``1,0`` -> [1.0, 0.0]: the decoding modes to run (0 is greedy); ValueError naming the option."""
    try:
        temperatures = [float(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--temperatures: {text!r} is not a comma list of numbers, e.g. 1,0") from None
    if any(t < 0 for t in temperatures):
        raise ValueError("--temperatures: a temperature is >= 0 (0 is greedy)")
    return temperatures


@dataclass
class Counts:
    """What one model generated in one decoding mode, prompt by prompt."""

    tokens: list[int] = field(default_factory=list)
    chars: list[int] = field(default_factory=list)
    letters: list[int] = field(default_factory=list)
    other_script: list[int] = field(default_factory=list)
    canonical: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    def add(self, text: str, tokens: int, canonical: int, seconds: float) -> None:
        """Count one prompt's generated ``text`` (``tokens`` generated, ``canonical`` re-encoded)."""
        self.tokens.append(tokens)
        self.chars.append(len(text))
        self.letters.append(len(ARABIC_LETTER.findall(text)))
        self.other_script.append(other_script_letters(text))
        self.canonical.append(canonical)
        self.seconds.append(seconds)
        self.texts.append(text)

    def summary(self) -> dict[str, Any]:
        """Tokens/s, characters and Arabic letters per token, Arabic letters/s, over all prompts."""
        tokens, seconds = sum(self.tokens), sum(self.seconds)
        return {
            "generated_tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "chars_per_token": sum(self.chars) / max(tokens, 1),
            "arabic_letters_per_token": sum(self.letters) / max(tokens, 1),
            "arabic_letters_per_s": sum(self.letters) / seconds,
            # letters of other scripts (Latin, Cyrillic, CJK, ...) per letter written: fragments of
            # other languages a sampled model drifts into, which count for nothing above
            "other_script_letter_share": sum(self.other_script) / max(sum(self.other_script) + sum(self.letters), 1),
            # the tokenizer's own encoding of the generated text, per generated token: below 1 the
            # model spells words with more (shorter) pieces than the tokenizer would
            "canonical_tokens_per_generated": sum(self.canonical) / max(tokens, 1),
            "per_prompt": {
                "tokens": self.tokens,
                "letters": self.letters,
                "seconds": self.seconds,
                "texts": self.texts,
            },
        }


def letters_per_s_ratio(ext: Counts, base: Counts, idx: list[int]) -> float:
    """Extended / base Arabic letters per second over the prompts ``idx`` (repeats allowed)."""
    ext_rate = sum(ext.letters[i] for i in idx) / sum(ext.seconds[i] for i in idx)
    base_rate = sum(base.letters[i] for i in idx) / sum(base.seconds[i] for i in idx)
    return ext_rate / base_rate


def letters_per_token_ratio(ext: Counts, base: Counts) -> float:
    """Extended / base Arabic letters per generated token: the ratio's part that does not depend
    on timing (the same texts measured twice move letters/s by a few percent, never this)."""
    return (sum(ext.letters) / max(sum(ext.tokens), 1)) / (sum(base.letters) / max(sum(base.tokens), 1))


def bootstrap_interval(ext: Counts, base: Counts, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """5th and 95th percentiles of the ratio over prompts resampled with replacement (paired:
    a prompt's two runs stay together), so the ratio's spread across prompts is visible."""
    rng = random.Random(seed)
    n = len(ext.letters)
    ratios = sorted(letters_per_s_ratio(ext, base, [rng.randrange(n) for _ in range(n)]) for _ in range(draws))
    return ratios[int(0.05 * draws)], ratios[int(0.95 * draws) - 1]


def mode_name(temperature: float) -> str:
    """``greedy`` or ``T=<t>``: the decoding mode's label in the table and the JSON."""
    return "greedy" if temperature == 0 else f"T={temperature:g}"
