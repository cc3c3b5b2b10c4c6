"""Byte-level BPE family (GPT-2/Llama-3/Qwen/tekken type): extend vocab AND merges.

Peers decline to extend this family because HF BPE applies *merges* by rank, not pieces by
score: a token added to the vocabulary without a merge that builds it is never emitted. Here
each new token gets exactly one merge, appended after every existing merge, whose two halves
are what the current tokenizer (base plus the merges added so far) turns the token's own text
into. Appending keeps every base merge's rank, so text without the target script encodes
exactly as before; and because the halves are the current encoding, the new merge is the last
step of the token's own encoding, so no added token is dead.

mistral-common's tekken files are tiktoken-style (ranked byte strings, no merges): they are
converted here into an HF ``tokenizers`` BPE with the ByteLevel pre-tokenizer, recovering
each token's merge by running BPE over its bytes with the ranks below its own.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

SUPPORTED = (
    "SentencePiece BPE (tokenizer.model), byte-level BPE (tokenizer.json with a ByteLevel"
    " pre-tokenizer), byte-fallback BPE (tokenizer.json with byte_fallback, e.g. Gemma)"
    " or a tiktoken/tekken json"
)


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character table that HF ByteLevel uses."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def to_unicode(data: bytes) -> str:
    """Bytes in ByteLevel's printable form."""
    table = byte_to_unicode()
    return "".join(table[b] for b in data)


def to_bytes(token: str) -> bytes:
    """Inverse of :func:`to_unicode`."""
    inverse = {c: b for b, c in byte_to_unicode().items()}
    return bytes(inverse[c] for c in token)


def is_tiktoken_json(path: Path) -> bool:
    """Whether a json file is mistral-common's tekken (tiktoken-style) format."""
    try:
        head = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(head, dict) and "vocab" in head and "config" in head and "pattern" in head["config"]


def bpe_split(token: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """Apply ``ranks`` (lowest first) to the characters of ``token``: what HF BPE does."""
    parts = list(token)
    while len(parts) > 1:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get((parts[i], parts[i + 1]))
            if r is not None and (best is None or r < best):
                best, at = r, i
        if best is None:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


def tiktoken_to_hf(path: Path, max_tokens: int | None = None) -> dict[str, Any]:
    """A tokenizer.json dict equivalent to a tekken file (specials first, then ranks).

    ``max_tokens`` keeps only the lowest ranks: any rank prefix of a tiktoken vocabulary is
    itself a valid BPE (each token's halves rank lower), which makes small test tokenizers.
    """
    data = json.loads(path.read_text())
    cfg = data["config"]
    n_special = int(cfg.get("default_num_special_tokens", 0))
    n_vocab = int(cfg.get("default_vocab_size", len(data["vocab"]) + n_special)) - n_special
    if max_tokens:
        n_vocab = min(n_vocab, max_tokens)
    entries = sorted(data["vocab"], key=lambda e: e["rank"])[:n_vocab]
    tokens = [to_unicode(base64.b64decode(e["token_bytes"])) for e in entries]
    merges = _recover_merges(tokens)
    specials = _special_names(n_special)
    vocab = {name: i for i, name in enumerate(specials)}
    vocab.update({tok: n_special + i for i, tok in enumerate(tokens)})
    return _tokenizer_json(vocab, merges, specials, cfg["pattern"])


def _recover_merges(tokens: list[str]) -> list[tuple[str, str]]:
    ranks: dict[tuple[str, str], int] = {}
    merges = []
    for tok in tokens:
        if len(tok) < 2:
            continue
        parts = bpe_split(tok, ranks)
        if len(parts) != 2:
            raise ValueError(f"tiktoken vocabulary: token {tok!r} has no two-part merge; not a BPE vocabulary")
        ranks[(parts[0], parts[1])] = len(merges)
        merges.append((parts[0], parts[1]))
    return merges


def _special_names(n: int) -> list[str]:
    named = ["<unk>", "<s>", "</s>"]
    return [named[i] if i < len(named) else f"<SPECIAL_{i}>" for i in range(n)]


def _tokenizer_json(
    vocab: dict[str, int], merges: list[tuple[str, str]], specials: list[str], pattern: str
) -> dict[str, Any]:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    if len(specials) > 1:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{specials[1]} $A", pair=f"{specials[1]} $A $B", special_tokens=[(specials[1], vocab[specials[1]])]
        )
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return json.loads(tok.to_str())


def check_byte_level(spec: dict[str, Any], where: str) -> None:
    """Refuse tokenizer.json files that are not byte-level BPE, naming what is supported."""
    model = spec.get("model") or {}
    kind = model.get("type")
    if kind != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        raise ValueError(
            f"{where}: a {kind or 'unknown'} tokenizer"
            f"{'' if kind != 'BPE' else ' without a ByteLevel pre-tokenizer'} is not supported;"
            f" supported families: {SUPPORTED}"
        )


def merge_list(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """Merges of a tokenizer.json in either serialisation (``"a b"`` or ``["a", "b"]``)."""
    out = []
    for m in spec["model"]["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        out.append((a, b))
    return out


def train_merges(spec: dict[str, Any], texts: Iterable[str], n_merges: int) -> list[tuple[str, str]]:
    """Train a byte-level BPE with the base's own normaliser and pre-tokenizer; its merges."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    base = Tokenizer.from_str(json.dumps(spec))
    tok = Tokenizer(models.BPE())
    tok.normalizer = base.normalizer
    tok.pre_tokenizer = base.pre_tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + n_merges, initial_alphabet=alphabet, show_progress=False, min_frequency=2
    )
    tok.train_from_iterator(texts, trainer)
    return merge_list(json.loads(tok.to_str()))


@dataclass
class ByteMerge:
    """The extended tokenizer.json and what went into it."""

    spec: dict[str, Any]
    added: list[str]
    skipped_in_base: int
    skipped_script: int
    skipped_no_path: int


def extend(
    spec: dict[str, Any], new_merges: list[tuple[str, str]], max_added: int, script: Callable[[str], bool] | None
) -> ByteMerge:
    """Append tokens and merges for the new model's tokens, in its learning order."""
    merges = merge_list(spec)
    ranks = {m: i for i, m in enumerate(merges)}
    vocab = dict(spec["model"]["vocab"])
    next_id = 1 + max([*vocab.values(), *(t["id"] for t in spec.get("added_tokens", []))])
    added: list[str] = []
    in_base = wrong_script = no_path = 0
    for a, b in new_merges:
        if len(added) >= max_added:
            break
        token = a + b
        if token in vocab:
            in_base += 1
            continue
        if script is not None and not script(to_bytes(token).decode("utf-8", errors="ignore")):
            wrong_script += 1
            continue
        parts = bpe_split(token, ranks)
        if len(parts) != 2:
            no_path += 1
            continue
        ranks[(parts[0], parts[1])] = len(merges)
        merges.append((parts[0], parts[1]))
        vocab[token] = next_id
        next_id += 1
        added.append(token)
    out = json.loads(json.dumps(spec))
    out["model"]["vocab"] = vocab
    out["model"]["merges"] = [list(m) for m in merges]
    return ByteMerge(out, added, in_base, wrong_script, no_path)


def write_tekken_side_files(out_dir: Path) -> None:
    """tokenizer_config.json and special_tokens_map.json for a converted tekken tokenizer."""
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
