"""The training text of the stages that teach new pieces: target-language documents with a share
of source-language ones."""

from __future__ import annotations

import random
from typing import Any


def mixed_texts(corpus: Any, source_fraction: float, seed: int, target_docs: int = 0) -> list[str]:
    """Target-language train documents (the first ``target_docs``; 0 = all) plus source-language
    ones making up ``source_fraction`` of the mix, shuffled with ``seed``.

    Mixing in the source language is what keeps English from drifting while the model learns
    the new pieces; the order is a pure function of the seed, identical for every run that
    shares it.
    """
    cfg = corpus.config
    tgt = corpus.texts(cfg.target_lang, "train")
    if target_docs:
        tgt = tgt[:target_docs]
    n_src = round(len(tgt) * source_fraction / (1 - source_fraction)) if source_fraction < 1 else len(tgt)
    texts = tgt + corpus.texts(cfg.source_lang, "train")[:n_src]
    random.Random(seed).shuffle(texts)
    return texts
