"""Replay: text the base model writes itself, kept with the base's own next-token distributions.

Why: adapting on one corpus (the hadith collections) moves the whole model toward it, and the
adapted model is then worse than its base on every other kind of text (issue 44: +13-35% bits
per character outside the corpus). Training on some of the base's own text with the base's own
distributions as soft labels (a distillation term against the frozen base) holds the model
near its base everywhere the corpus does not pull it. The base writes this text, so no data
from another domain is needed, and nothing a stage is evaluated on is trained on.

The prompts carry no domain: each sequence starts with BOS and two whole-word tokens of its
language's script drawn from the base vocabulary; the base samples the rest at temperature 1
(its own distribution), and at every position the top ``k`` of its next-token distribution is
recorded, renormalised, while it writes. The replay ids are base ids, which the extended
model reads as they are (its vocabulary keeps every base id), so the soft labels are exact
for both the extended model and the same-budget base.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

WORD_START = ("\u2581", "\u0120")  # SentencePiece's and byte-level BPE's word-start markers
SCRIPTS = {"ar": re.compile("^[\u0621-\u064a]{2,}$"), "en": re.compile("^[a-z]{2,}$")}
PROMPT_WORDS = 2


@dataclass
class Replay:
    """Base-written sequences and the base's top-``k`` next-token distributions along them."""

    ids: torch.Tensor  # int64 [N, L], BOS first
    top_ids: torch.Tensor  # int64 [N, L-1, k]: at position t, the top-k tokens after ids[:, :t+1]
    top_probs: torch.Tensor  # float32 [N, L-1, k], each row renormalised to sum 1
    langs: list[str]

    def batch(self, rows: list[int]) -> dict[str, torch.Tensor]:
        """The rows as a ``warsha.lm_loss.soft_lm_loss`` batch."""
        index = torch.tensor(rows)
        return {
            "input_ids": self.ids[index],
            "teacher_ids": self.top_ids[index],
            "teacher_probs": self.top_probs[index],
        }

    def save(self, path: Path) -> None:
        """Written once per stage run, so a resumed run trains on the same sequences."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"ids": self.ids, "top_ids": self.top_ids, "top_probs": self.top_probs, "langs": self.langs}, tmp)
        tmp.rename(path)

    def texts(self, tok: Any) -> list[str]:
        """The sequences as text (``tok``, the base tokenizer, decodes them), for a model that
        reads them through its own tokenizer."""
        return [text.strip() for text in tok.batch_decode(self.ids, skip_special_tokens=True)]

    @classmethod
    def load(cls, path: Path) -> Replay:
        """Inverse of ``save``."""
        data = torch.load(path, weights_only=True)
        return cls(ids=data["ids"], top_ids=data["top_ids"], top_probs=data["top_probs"], langs=list(data["langs"]))


def word_tokens(tok: Any, lang: str) -> list[int]:
    """Ids of whole-word tokens (a word-start marker, then two or more letters of ``lang``'s script)."""
    pattern = SCRIPTS.get(lang)
    if pattern is None:
        raise ValueError(f"replay: no script known for language {lang!r} (known: {', '.join(SCRIPTS)})")
    found = []
    for i, piece in enumerate(tok.convert_ids_to_tokens(list(range(len(tok))))):
        if piece and piece.startswith(WORD_START) and pattern.match(piece[1:]):
            found.append(i)
    if not found:
        raise ValueError(f"replay: the tokenizer has no whole-word {lang!r} tokens to start sequences with")
    return found


def prompts(tok: Any, langs: list[str], seed: int) -> list[list[int]]:
    """BOS and ``PROMPT_WORDS`` random whole-word tokens of each sequence's language."""
    rng = random.Random(seed)
    words = {lang: word_tokens(tok, lang) for lang in set(langs)}
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    return [bos + [rng.choice(words[lang]) for _ in range(PROMPT_WORDS)] for lang in langs]


GENERATE_BATCH = 64
"""Sequences sampled together. A decode step of a small model on a CPU is mostly per-op overhead,
so more rows per step cost little more: the real recipe's 30 replay sequences took two batches of
60 s at 16 and take one of about 80 s now (the stage's replay 128 -> 88 s with the model's load,
Zen 4, 2 threads), of which 64 s were ``torch.multinomial``'s draws (``warsha.sampling`` now).
Memory stays small: the cache holds ``batch * seq_len`` positions and each step's logits
``batch * vocab`` floats."""


def generate(
    model: Any, tok: Any, langs: list[str], seq_len: int, k: int, seed: int, batch: int = GENERATE_BATCH
) -> Replay:
    """Sample one ``seq_len``-token sequence per entry of ``langs`` from ``model`` at temperature
    1, recording its top-``k`` next-token distribution at every position."""
    from warsha.progress import progress

    starts = prompts(tok, langs, seed)
    if seq_len <= len(starts[0]):
        raise ValueError(f"replay: seq_len {seq_len} leaves no room after a {len(starts[0])}-token prompt")
    gen = torch.Generator().manual_seed(seed)
    parts = []
    model.eval()
    for s in progress(range(0, len(starts), batch), desc="replay", unit="batch", leave=False):
        parts.append(_sample(model, torch.tensor(starts[s : s + batch]), seq_len, k, gen))
    return Replay(
        ids=torch.cat([p[0] for p in parts]),
        top_ids=torch.cat([p[1] for p in parts]),
        top_probs=torch.cat([p[2] for p in parts]),
        langs=list(langs),
    )


def written_texts(model: Any, tok: Any, lang: str, n: int, seq_len: int, seed: int) -> list[str]:
    """``n`` documents of ``lang`` the base writes itself (``generate``), as text: for stages that
    read them through another tokenizer (``embed``'s fit reads them with the extended one)."""
    return generate(model, tok, [lang] * n, seq_len, 1, seed, batch=n).texts(tok)


def _sample(
    model: Any, prompt: torch.Tensor, seq_len: int, k: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch: the KV cache carries the prefix, each step records then samples."""
    from warsha.sampling import draw

    device = next(model.parameters()).device
    ids = prompt.to(device)
    tops: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        for t in range(prompt.shape[1] - 1):
            tops.append(_top(out.logits[:, t], k))
        logits = out.logits[:, -1]
        while ids.shape[1] < seq_len:
            probs, top = torch.softmax(logits.float(), -1), _top(logits, k)
            tops.append(top)
            nxt = draw(probs, gen).to(device)
            ids = torch.cat([ids, nxt], 1)
            if ids.shape[1] == seq_len:
                break
            out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
            logits = out.logits[:, -1]
    return ids.cpu(), torch.stack([t[0] for t in tops], 1).cpu(), torch.stack([t[1] for t in tops], 1).cpu()


def _top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` token ids and their probabilities renormalised over those ``k``."""
    values, index = torch.topk(logits.float(), k, -1)
    return index, torch.softmax(values, -1)
