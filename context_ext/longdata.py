"""Training and evaluation text for the long-context fine-tune, with the splits kept apart.

- Training sequences come only from the corpus's train split: packed documents of the target
  length, a share of them replaced by synthetic passkey samples (training keys, training
  depths, train-split filler). Every method fine-tunes on byte-identical batches, since each
  batch is a pure function of (seed, step, micro-step, rank).
- Evaluation filler and perplexity text come from the validation and test splits.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from context_ext import passkey
from warsha import synthetic

if TYPE_CHECKING:
    import torch

    from warsha.data import Corpus


def heldout_texts(corpus: "Corpus", lang: str) -> list[str]:
    """Validation then test documents of ``lang``, minus any text that also occurs in train.

    Splits go by document id, and the corpus repeats some texts under several ids; a held-out
    copy of a trained text would flatter perplexity, so exact duplicates are dropped here.
    """
    trained = set(corpus.texts(lang, "train"))
    texts = [t for t in corpus.texts(lang, "validation") + corpus.texts(lang, "test") if t not in trained]
    if not texts:
        raise ValueError(f"data: no held-out {lang!r} documents (validation and test splits are empty)")
    return texts


def train_texts(corpus: "Corpus", lang: str) -> list[str]:
    """Train-split documents of ``lang`` (the only text the fine-tune sees)."""
    texts = corpus.texts(lang, "train")
    if not texts:
        raise ValueError(f"data: no train-split {lang!r} documents for the long-context fine-tune")
    return texts


def long_documents(tokenizer: Any, texts: Sequence[str], n_docs: int, min_tokens: int) -> list[str]:
    """Join consecutive held-out documents into ``n_docs`` texts of at least ``min_tokens`` tokens.

    Hadith documents are a few hundred tokens long; perplexity at 8x the context needs
    documents longer than the window, or the long windows would have nothing to condition on.
    """
    out: list[str] = []
    parts: list[str] = []
    count = 0
    lengths = [len(x) for x in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
    for text, n in zip(texts, lengths):
        parts.append(text)
        count += n + 1
        if count >= min_tokens:
            out.append("\n".join(parts))
            parts, count = [], 0
            if len(out) == n_docs:
                return out
    raise ValueError(
        f"data: held-out text holds {len(out)} documents of {min_tokens} tokens, {n_docs} needed;"
        " lower ppl_documents or add validation/test text"
    )


@dataclass
class LongBatches:
    """Training batches: packed corpus windows, passkey samples and repeated-span copy rows.

    Why three kinds: a small model that was never trained on retrieval has no induction
    (copy) circuit, and one passkey answer per thousand tokens is far too sparse a signal to
    grow one in a couple of hundred steps. Rows
    that repeat a filler span several times make most of their tokens copy targets, the
    densest copy signal there is (at the demo's size it still did not grow the circuit in a
    few hundred steps; see ``warsha.synthetic``); passkey rows teach the prompt format; corpus
    rows keep the language model, in both languages when ``source_fraction`` > 0. Loss weights
    are zero outside the scored tokens, so the LM head only runs where it is needed (see ``weighted_lm_loss``).

    A curriculum doubles the row length from ``start_len`` up to ``seq_len`` over the first
    ``curriculum`` share of steps, with the same number of tokens per step: copying is learnt
    cheaply on short rows, then carried to the extended positions.
    """

    stream: "torch.Tensor"
    filler: list[int]
    fmt: passkey.PasskeyFormat
    seq_len: int
    batch_size: int
    retrieval_fraction: float
    seed: int
    avoid_depths: tuple[float, ...] = passkey.EVAL_DEPTHS
    answer_weight: float = 1.0
    copy_fraction: float = 0.0
    start_len: int | None = None
    steps: int = 1
    curriculum: float = 0.0
    lm_positions: float = 1.0

    def length_at(self, step: int) -> int:
        """Row length of ``step``: doubling from ``start_len`` to ``seq_len`` during the curriculum."""
        if not self.start_len or self.start_len >= self.seq_len or self.curriculum <= 0:
            return self.seq_len
        stages, n = [], self.start_len
        while n < self.seq_len:
            stages.append(n)
            n *= 2
        ramp = max(1, int(self.curriculum * self.steps))
        if step >= ramp:
            return self.seq_len
        return stages[step * len(stages) // ramp]

    def rows_at(self, step: int) -> int:
        """Rows per micro-batch at ``step``: tokens per step stay ``batch_size * seq_len``."""
        return max(1, self.batch_size * self.seq_len // self.length_at(step))

    def __call__(self, step: int, micro: int, rank: int) -> dict[str, "torch.Tensor"]:
        """The batch for one (step, micro-step, rank): the same for every method and rerun."""
        import torch

        from warsha.training import random_windows

        rng = random.Random(f"{self.seed}:{step}:{micro}:{rank}")
        length, n_rows = self.length_at(step), self.rows_at(step)
        windows = random_windows(self.stream, n_rows, length, self.seed, step, micro, rank)
        rows, weights = [], []
        for i in range(n_rows):
            draw = rng.random()
            if draw < self.retrieval_fraction:
                depth = passkey.train_depth(rng, self.avoid_depths)
                sample = passkey.make_sample(self.fmt, self.filler, length, depth, rng, "train")
                w = [0.0] * length
                w[-sample.answer_len :] = [self.answer_weight] * sample.answer_len
                # the key's second mention in the needle is a short-range copy target too
                rows.append(sample.input_ids)
                weights.append(_mark_repeats(sample.input_ids, w, sample.answer_len))
            elif draw < self.retrieval_fraction + self.copy_fraction:
                ids, w = synthetic.repeat_row(self.filler, length, rng, self.fmt.tokenizer.bos_token_id)
                rows.append(ids)
                weights.append(w)
            else:
                rows.append(windows[i].tolist())
                weights.append([1.0 if rng.random() < self.lm_positions else 0.0 for _ in range(length)])
        return {"input_ids": torch.tensor(rows), "loss_weights": torch.tensor(weights)}


def _mark_repeats(ids: list[int], weights: list[float], answer_len: int) -> list[float]:
    """Weight 1 on the digits of the key's second mention inside the needle (a copy target)."""
    key = ids[-answer_len:]
    hits = [i for i in range(len(ids) - answer_len) if ids[i : i + answer_len] == key]
    if len(hits) >= 2:
        second = hits[1]
        for j in range(second + 2, second + answer_len):
            weights[j] = max(weights[j], 1.0)
    return weights


def make_batches(
    tokenizer: Any,
    corpus: "Corpus",
    lang: str,
    seq_len: int,
    batch_size: int,
    retrieval_fraction: float,
    seed: int,
    max_tokens: int = 4_000_000,
    avoid_depths: Sequence[float] = passkey.EVAL_DEPTHS,
    answer_weight: float = 1.0,
    copy_fraction: float = 0.0,
    start_len: int | None = None,
    steps: int = 1,
    curriculum: float = 0.0,
    lm_positions: float = 1.0,
    max_stream_tokens: int | None = None,
    source_lang: str | None = None,
    source_fraction: float = 0.0,
) -> LongBatches:
    """The fine-tune's batch function over the train split of ``lang``.

    With ``source_fraction`` > 0 that share of the corpus tokens comes from ``source_lang``'s
    train split: a fine-tune on the target language alone tripled the demo model's English
    perplexity in 40 steps, and nothing in a target-language evaluation shows it.
    """
    import torch

    from warsha.training import pack_documents

    texts = train_texts(corpus, lang)
    random.Random(seed).shuffle(texts)
    budget = max_stream_tokens or max_tokens
    n_source = int(budget * source_fraction) if source_lang and source_lang != lang else 0
    stream = pack_documents(tokenizer, texts, budget - n_source)
    if n_source:
        other = train_texts(corpus, source_lang)  # type: ignore[arg-type]
        random.Random(seed + 1).shuffle(other)
        stream = torch.cat([stream, pack_documents(tokenizer, other, n_source)])
    filler = passkey.filler_stream(tokenizer, texts[: min(len(texts), 2000)])
    fmt = passkey.PasskeyFormat(tokenizer)
    return LongBatches(
        stream,
        filler,
        fmt,
        seq_len,
        batch_size,
        retrieval_fraction,
        seed,
        tuple(avoid_depths),
        answer_weight,
        copy_fraction,
        start_len,
        steps,
        curriculum,
        lm_positions,
    )
