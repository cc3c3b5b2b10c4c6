"""Passkey retrieval: a random 5-digit key hidden at a chosen depth in filler text.

The prompt is built in token space, so every sample is exactly the requested length and the
needle sits exactly at the requested depth whatever the tokenizer does at piece boundaries:

    <bos> filler[:k] "The pass key is 12345. Remember it. 12345 is the pass key." filler[k:]
    "What is the pass key? The pass key is" -> " 12345"

The needle states the key twice and the question repeats the needle's words, so answering is
one induction step (find "The pass key is", copy what follows) that a four-layer model can
learn in a couple of hundred steps. Training samples (``make_sample`` with ``split="train"``)
and evaluation samples use disjoint key sets (a hash of the key decides) and disjoint depths;
the caller gives them filler from disjoint corpus splits.

Scoring is exact greedy match, computed with one forward pass: greedy decoding reproduces the
key iff, with the key's own earlier tokens as context, the argmax at every answer position is
the key's next token (the first wrong argmax is where greedy decoding would diverge).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
EVAL_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
DEPTH_MARGIN = 0.02  # training depths stay this far from every evaluation depth


def key_split(key: int) -> str:
    """``eval`` for a quarter of all 5-digit keys (by hash), ``train`` for the rest.

    A hash, not a digit rule: a rule such as parity would let a model learn that the last
    digit of a training key is odd and score differently on evaluation keys.
    """
    return "eval" if hashlib.sha256(str(key).encode()).digest()[0] % 4 == 0 else "train"


def draw_key(rng: random.Random, split: str) -> str:
    """A uniformly random 5-digit key from one split's key set."""
    while True:
        key = rng.randrange(10000, 100000)
        if key_split(key) == split:
            return str(key)


def train_depth(rng: random.Random, avoid: Sequence[float] = EVAL_DEPTHS) -> float:
    """A training depth in [0.02, 0.98] at least ``DEPTH_MARGIN`` from every evaluation depth."""
    while True:
        depth = rng.uniform(0.02, 0.98)
        if all(abs(depth - a) >= DEPTH_MARGIN for a in avoid):
            return depth


@dataclass
class PasskeyFormat:
    """The tokenized pieces of the prompt for one tokenizer."""

    tokenizer: Any
    needle: str = NEEDLE
    question: str = QUESTION
    question_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.question_ids = self._encode(self.question)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def needle_ids(self, key: str) -> list[int]:
        """The needle sentence with the key in it."""
        return self._encode(self.needle.format(key=key))

    def answer_ids(self, key: str) -> list[int]:
        """The key's tokens as they follow the question (tail of question + " " + key)."""
        full = self._encode(f"{self.question} {key}")
        if full[: len(self.question_ids)] != self.question_ids:
            raise ValueError(
                "passkey: the tokenizer merges the question's last piece with the key;"
                " change the question so it ends on a word boundary"
            )
        return full[len(self.question_ids) :]

    def overhead(self, key: str) -> int:
        """Tokens that are not filler: BOS, needle, question and answer."""
        return 1 + len(self.needle_ids(key)) + len(self.question_ids) + len(self.answer_ids(key))


@dataclass
class Sample:
    """One prompt followed by its answer; ``answer_len`` trailing tokens are the key."""

    input_ids: list[int]
    answer_len: int
    depth: float
    key: str


def filler_stream(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """Concatenated tokens of ``texts``: the haystack that samples are cut from."""
    if not texts:
        raise ValueError("passkey: no filler texts (the corpus split is empty)")
    ids: list[int] = []
    for row in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        ids.extend(row)
    return ids


def make_sample(
    fmt: PasskeyFormat, filler: Sequence[int], length: int, depth: float, rng: random.Random, split: str
) -> Sample:
    """A sample of exactly ``length`` tokens, the needle after ``depth`` of the filler."""
    key = draw_key(rng, split)
    needle, answer = fmt.needle_ids(key), fmt.answer_ids(key)
    n_fill = length - fmt.overhead(key)
    if n_fill < 1:
        raise ValueError(f"passkey: length {length} is too short for the prompt ({fmt.overhead(key)} tokens)")
    start = rng.randrange(len(filler))
    fill = [filler[(start + i) % len(filler)] for i in range(n_fill)]
    cut = round(depth * n_fill)
    bos = fmt.tokenizer.bos_token_id
    ids = [bos if bos is not None else fill[0]] + fill[:cut] + needle + fill[cut:] + fmt.question_ids + answer
    return Sample(ids, len(answer), depth, key)


def eval_samples(
    fmt: PasskeyFormat,
    filler: Sequence[int],
    length: int,
    depths: Sequence[float],
    rounds: int,
    seed: int,
    start: int = 0,
) -> list[Sample]:
    """Rounds ``start..start+rounds`` of evaluation samples, one per depth per round.

    Sample (length, round, depth) depends only on the seed, so every method is scored on the
    very same prompts, and a run that needs more rounds extends the earlier ones.
    """
    out = []
    for r in range(start, start + rounds):
        for j, depth in enumerate(depths):
            rng = random.Random(f"{seed}:{length}:{r}:{j}")
            out.append(make_sample(fmt, filler, length, depth, rng, "eval"))
    return out


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval for a binomial proportion (sound near 0 and 1, unlike Wald)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def greedy_hits(model: Any, samples: Sequence[Sample]) -> list[bool]:
    """Exact greedy match for a batch of equal-length samples, in one forward pass."""
    import torch

    keep = max(s.answer_len for s in samples) + 1
    ids = torch.tensor([s.input_ids for s in samples])
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(input_ids=ids.to(device), logits_to_keep=keep).logits
    preds = logits.argmax(-1).cpu()  # preds[:, i] predicts token at position L - keep + i + 1
    hits = []
    for row, s in enumerate(samples):
        answer = ids[row, -s.answer_len :]
        guess = preds[row, keep - 1 - s.answer_len : keep - 1]
        hits.append(bool(torch.equal(answer, guess)))
    return hits


@dataclass
class CellResult:
    """Passkey accuracy at one length, with its 95% interval and per-depth breakdown."""

    length: int
    trials: int
    hits: int
    per_depth: dict[str, float]

    @property
    def accuracy(self) -> float:
        """Fraction of exact greedy matches."""
        return self.hits / max(self.trials, 1)

    def as_dict(self) -> dict[str, Any]:
        """Manifest form."""
        low, high = wilson(self.hits, self.trials)
        return {
            "accuracy": self.accuracy,
            "ci95": [low, high],
            "trials": self.trials,
            "per_depth": self.per_depth,
        }


def evaluate_length(
    model: Any,
    fmt: PasskeyFormat,
    filler: Sequence[int],
    length: int,
    depths: Sequence[float] = EVAL_DEPTHS,
    min_trials: int = 40,
    max_trials: int = 400,
    half_width: float = 0.05,
    batch_size: int = 4,
    seed: int = 0,
) -> CellResult:
    """Add rounds (one sample per depth) until the 95% interval's half-width <= ``half_width``.

    Accuracies near 0 or 1 reach +-5% in a few dozen trials; near 0.5 it takes ~385. Stopping
    on the interval, not a fixed count, keeps evaluation fast while every reported cell meets
    the precision it claims (``max_trials`` caps the cost; the interval is always reported).
    """
    by_depth: dict[float, list[bool]] = {d: [] for d in depths}
    rounds_done = 0
    while True:
        total = sum(len(v) for v in by_depth.values())
        hits = sum(sum(v) for v in by_depth.values())
        low, high = wilson(hits, total)
        if total >= max_trials or (total >= min_trials and (high - low) / 2 <= half_width):
            break
        rounds = max(1, -(-max(min_trials - total, batch_size) // len(depths)))
        rounds = min(rounds, -(-(max_trials - total) // len(depths)))
        samples = eval_samples(fmt, filler, length, depths, rounds, seed, rounds_done)
        rounds_done += rounds
        for start in range(0, len(samples), batch_size):
            chunk = samples[start : start + batch_size]
            for s, hit in zip(chunk, greedy_hits(model, chunk)):
                by_depth[s.depth].append(hit)
    per_depth = {f"{d:g}": sum(v) / max(len(v), 1) for d, v in by_depth.items()}
    return CellResult(length, total, hits, per_depth)
