"""Training rows that teach a small model to retrieve: digit copies, passkey samples, corpus text.

`python -m benchmarks.retrieval_standin` trains a base model on this mix until it retrieves a
passkey at its own context, so that the context benchmark can measure whether a RoPE scaling
keeps that skill beyond it (its docstring says why a stand-in is needed). The rows never use
the evaluation's keys or depths (`passkey.train_depth`, split ``"train"``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from context_ext import passkey
from warsha import synthetic

DIGITS = "0123456789"


def digit_ids(tokenizer: Any) -> list[int]:
    """The ten single-digit tokens, as they occur inside a number (``" 0123456789"`` split).

    Refuses a tokenizer that merges digits: the rows below assume one token per digit, as the
    Llama and Mistral SentencePiece models (``split_digits``) give.
    """
    ids = list(tokenizer(" " + DIGITS, add_special_tokens=False)["input_ids"])[-10:]
    if len(set(ids)) != 10 or tokenizer.decode(ids).replace(" ", "") != DIGITS:
        raise ValueError("--model: its tokenizer does not split numbers into single digits; digit rows need it")
    return ids


def digit_row(digits: Sequence[int], length: int, rng: random.Random, bos: int | None) -> tuple[list[int], list[float]]:
    """BOS + a random string of 6-24 digits repeated to ``length`` tokens, with loss weights.

    Every digit of a repeat is a copy target (weight 1) except a repeat's first, which follows
    the previous repeat's last digit and is predictable only from the span length. Ten symbols,
    not the whole vocabulary: the copy circuit forms where each symbol recurs often (random
    tokens from a 20k vocabulary taught the demo model nothing in 375 steps).
    """
    span = [rng.choice(digits) for _ in range(rng.randint(6, 24))]
    return synthetic.fill_repeats(span, length, bos)


def passkey_row(
    fmt: passkey.PasskeyFormat, filler: Sequence[int], length: int, rng: random.Random
) -> tuple[list[int], list[float]]:
    """A training passkey sample; loss on the answer and on the needle's repeat of the key."""
    sample = passkey.make_sample(fmt, filler, length, passkey.train_depth(rng), rng, "train")
    ids, n = sample.input_ids, sample.answer_len
    weights = [0.0] * (length - n) + [1.0] * n
    key = ids[-n:]
    mentions = [i for i in range(length - n) if ids[i : i + n] == key]
    if len(mentions) >= 2:  # the second mention's digits after the first are copies of the first's
        for j in range(mentions[1] + 2, mentions[1] + n):
            weights[j] = 1.0
    return ids, weights


@dataclass
class RowMix:
    """Batches of passkey, digit and corpus rows; each step a pure function of (seed, step)."""

    fmt: passkey.PasskeyFormat
    filler: list[int]
    corpus: list[int]
    digits: list[int]
    lengths: list[int]
    tokens: int
    digit_fraction: float
    lm_fraction: float
    seed: int = 0

    def __call__(self, step: int) -> dict[str, Any]:
        import torch

        rng = random.Random(f"retrieval:{self.seed}:{step}")
        length = rng.choice(self.lengths)
        bos = self.fmt.tokenizer.bos_token_id
        rows, weights = [], []
        for _ in range(max(1, self.tokens // length)):
            draw = rng.random()
            if draw < self.digit_fraction:
                ids, w = digit_row(self.digits, length, rng, bos)
            elif draw < self.digit_fraction + self.lm_fraction:
                start = rng.randrange(len(self.corpus) - length)
                ids, w = [bos] + self.corpus[start : start + length - 1], [0.0] + [1.0] * (length - 1)
            else:
                ids, w = passkey_row(self.fmt, self.filler, length, rng)
            rows.append(ids)
            weights.append(w)
        return {"input_ids": torch.tensor(rows), "loss_weights": torch.tensor(weights)}


def row_lengths(spec: str, context: int) -> list[int]:
    """Parse ``--lengths``; every length must fit the base's own context (no extension here)."""
    lengths = [int(x) for x in spec.split(",") if x.strip()]
    bad = [n for n in lengths if not 48 <= n <= context]
    if not lengths or bad:
        raise SystemExit(f"--lengths: each must be in 48..{context} (the model's max_position_embeddings), got {spec}")
    return lengths


def rate(peak: float, step: int, steps: int, schedule: str) -> float:
    """10 warm-up steps, then ``constant`` or cosine decay to a tenth.

    Why both: the copy circuit forms in a sudden phase change, and on the demo bootstrap it
    formed only at a steady rate (constant 1e-3: 256-token accuracy 0% -> 85% between steps
    300 and 1000; cosine decay in every phase: under 10% after 1900 steps). Once it has formed,
    a constant rate leaves the accuracy wandering (68-92% over 500 steps) and a short cosine
    phase settles it.
    """
    import math

    if step < 10:
        return peak * (step + 1) / 10
    if schedule == "constant":
        return peak
    progress = (step - 10) / max(1, steps - 10)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def check(model: Any, fmt: passkey.PasskeyFormat, filler: list[int], length: int, trials: int) -> float:
    """Passkey accuracy at ``length`` on evaluation keys, depths and held-out filler."""
    rounds = -(-trials // len(passkey.EVAL_DEPTHS))
    # seed 1: evaluation keys and depths, but not the very prompts context_bench scores (seed 0)
    samples = passkey.eval_samples(fmt, filler, length, passkey.EVAL_DEPTHS, rounds, seed=1)
    model.eval()
    hits = sum(sum(passkey.greedy_hits(model, samples[i : i + 8])) for i in range(0, len(samples), 8))
    model.train()
    return hits / len(samples)
