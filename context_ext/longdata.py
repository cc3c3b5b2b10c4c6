"""Training and evaluation text for the long-context fine-tune, with the splits kept apart.

- Training sequences come only from the corpus's train split: packed documents of the target
  length, a share of them replaced by synthetic passkey samples (training keys, training
  depths, train-split filler). Every method fine-tunes on byte-identical batches, since each
  batch is a pure function of (seed, step, micro-step, rank).
- Evaluation filler and perplexity text come from the validation and test splits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from context_ext import passkey

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
    """Batches of ``seq_len`` tokens: packed corpus windows mixed with passkey samples."""

    stream: "torch.Tensor"
    filler: list[int]
    fmt: passkey.PasskeyFormat
    seq_len: int
    batch_size: int
    retrieval_fraction: float
    seed: int
    avoid_depths: tuple[float, ...] = passkey.EVAL_DEPTHS
    answer_weight: float = 1.0

    def __call__(self, step: int, micro: int, rank: int) -> dict[str, "torch.Tensor"]:
        """The batch for one (step, micro-step, rank): the same for every method and rerun."""
        import torch

        from warsha.training import random_windows

        rng = random.Random(f"{self.seed}:{step}:{micro}:{rank}")
        windows = random_windows(self.stream, self.batch_size, self.seq_len, self.seed, step, micro, rank)
        rows = []
        weights = torch.ones(self.batch_size, self.seq_len)
        for i in range(self.batch_size):
            if rng.random() < self.retrieval_fraction:
                depth = passkey.train_depth(rng, self.avoid_depths)
                sample = passkey.make_sample(self.fmt, self.filler, self.seq_len, depth, rng, "train")
                rows.append(torch.tensor(sample.input_ids))
                weights[i, -sample.answer_len :] = self.answer_weight
            else:
                rows.append(windows[i])
        return {"input_ids": torch.stack(rows), "loss_weights": weights}


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
) -> LongBatches:
    """The fine-tune's batch function over the train split of ``lang``."""
    from warsha.training import pack_documents

    texts = train_texts(corpus, lang)
    random.Random(seed).shuffle(texts)
    stream = pack_documents(tokenizer, texts, max_tokens)
    filler = passkey.filler_stream(tokenizer, texts[: min(len(texts), 2000)])
    fmt = passkey.PasskeyFormat(tokenizer)
    return LongBatches(
        stream, filler, fmt, seq_len, batch_size, retrieval_fraction, seed, tuple(avoid_depths), answer_weight
    )


def weighted_lm_loss(model: Any, batch: dict[str, "torch.Tensor"]) -> "torch.Tensor":
    """Next-token loss with per-target weights (``loss_weights[t]`` weighs predicting token t).

    With every weight 1 this is the plain causal-LM loss. A weight above 1 on the passkey's
    answer tokens gives the six tokens that carry the retrieval signal a voice against the
    thousand filler tokens around them, without changing which text is trained on.
    """
    import torch.nn.functional as F

    logits = model(input_ids=batch["input_ids"]).logits[:, :-1].float()
    target = batch["input_ids"][:, 1:]
    weights = batch["loss_weights"][:, 1:].to(logits.dtype)
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="none")
    return (nll * weights.reshape(-1)).sum() / weights.sum()
