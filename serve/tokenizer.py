"""Tokenizer from `tokenizer.json` via the `tokenizers` library (no transformers).

BOS/EOS come from tokenizer_config.json, generation_config.json and config.json, the places an
HF model directory may keep them; the BOS is prepended when the config asks for it and the
tokenizer's own post-processor did not already add it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as {'content': ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class Tokenizer:
    """Encode/decode plus the special ids the engine stops on."""

    def __init__(self, model_dir: str | Path) -> None:
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found; serve needs a fast tokenizer file (save the tokenizer with transformers or "
                "tokenizers)"
            )
        self._tok = HFTokenizer.from_file(str(path))
        cfg = _read_json(root / "tokenizer_config.json")
        gen = _read_json(root / "generation_config.json")
        model_cfg = _read_json(root / "config.json")
        bos = _token_content(cfg.get("bos_token"))
        eos = _token_content(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(bos) if bos else None
        if self.bos_token_id is None:
            ids = _as_id_list(gen.get("bos_token_id", model_cfg.get("bos_token_id")))
            self.bos_token_id = ids[0] if ids else None
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        eos_ids = set(_as_id_list(gen.get("eos_token_id"))) | set(_as_id_list(model_cfg.get("eos_token_id")))
        if eos and self._tok.token_to_id(eos) is not None:
            eos_ids.add(self._tok.token_to_id(eos))
        self.eos_token_ids = eos_ids

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        """The piece for `token_id`, None when the id is unused."""
        return self._tok.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with BOS when the model expects one.

        `encode_batch` rather than `encode`: the tokenizers binding releases the GIL only in the
        batch call, so a server tokenising a long prompt in a worker thread keeps answering."""
        ids = self._tok.encode_batch([text], add_special_tokens=True)[0].ids
        if self.add_bos_token and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens skipped."""
        return self._tok.decode(ids, skip_special_tokens=True)


def first_vocab_difference(target: Tokenizer, draft: Tokenizer) -> tuple[int, str | None, str | None] | None:
    """The first id whose piece differs between the two tokenizers, or None if they agree."""
    for i in range(max(target.vocab_size, draft.vocab_size)):
        a, b = target.id_to_token(i), draft.id_to_token(i)
        if a != b:
            return i, a, b
    return None
