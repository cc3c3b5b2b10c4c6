"""Read HF safetensors checkpoints directly: one file, or shards listed in an index."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of `model_dir`, from the index when the checkpoint is sharded."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index} has no 'weight_map'; the sharded checkpoint index is malformed")
        files = sorted({root / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are missing: {missing}")
        return files
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {root}; save the model with safetensors"
    )


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint on CPU, keyed by their HF names."""
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


DRAFT_VOCAB_FILE = "draft_vocab.json"


def read_draft_vocab(path: Path) -> list[int]:
    """The draft's head restriction: `{"token_ids": [...]}`, most frequent first.

    Written by the distill stage beside an ordinary HF draft (whose head keeps every row, so
    other engines load it unchanged); the serve engine reads it and computes draft logits for
    these ids only.
    """
    try:
        ids = json.loads(Path(path).read_text())["token_ids"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: expected a JSON object with a 'token_ids' list ({exc})") from exc
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{path}: 'token_ids' must be a list of integers")
    return ids
