"""Calibration batches: documents packed into fixed-length token rows.

Why packing: real calibration text is a mix of short and long documents. Dropping documents
shorter than the sequence length (a common silent failure) can leave zero samples, and
truncating long ones wastes text. Here documents are shuffled deterministically, joined with
BOS/EOS separators into one token stream and cut into ``n_samples`` rows of ``seq_len``; if the
corpus cannot fill them, that is an error that says how many tokens were found.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch


def interleave(per_lang: Sequence[Sequence[str]], seed: int) -> list[str]:
    """Shuffle each language's documents and alternate between languages."""
    rng = random.Random(seed)
    pools = []
    for docs in per_lang:
        docs = [d for d in docs if d and d.strip()]
        rng.shuffle(docs)
        pools.append(docs)
    out = []
    for i in range(max((len(p) for p in pools), default=0)):
        out.extend(p[i] for p in pools if i < len(p))
    return out


def calibration_ids(
    tokenizer: Any, texts: Sequence[str], n_samples: int, seq_len: int, chunk: int = 64
) -> torch.Tensor:
    """``[n_samples, seq_len]`` token ids packed from ``texts`` in order."""
    if n_samples < 1 or seq_len < 2:
        raise ValueError(f"quantize: n_samples must be >= 1 and seq_len >= 2, got {n_samples} and {seq_len}")
    need = n_samples * seq_len
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for start in range(0, len(texts), chunk):
        batch = list(texts[start : start + chunk])
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            if ids:
                stream.extend(bos + ids + eos)
        if len(stream) >= need:
            break
    if len(stream) < need:
        raise ValueError(
            f"quantize: calibration needs n_samples x seq_len = {n_samples} x {seq_len} = {need} tokens,"
            f" but the corpus's train split gives only {len(stream)} tokens from {len(texts)} documents;"
            " lower n_samples or seq_len, or add calibration text"
        )
    return torch.tensor(stream[:need], dtype=torch.long).reshape(n_samples, seq_len)
