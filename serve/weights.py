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
    """All tensors of the checkpoint on CPU, keyed by their HF names (int8 rows widened)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return widen_int8_rows(tensors, model_dir)


INT8_SUFFIX, SCALE_SUFFIX = ".weight_int8", ".weight_scale"


def widen_int8_rows(tensors: dict[str, torch.Tensor], model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Replace each int8-row pair (``<m>.weight_int8`` int8 [rows, cols], ``<m>.weight_scale``
    [rows]: the 8-bit embedding and head of quantize's ``embedding_bits: 8``, FORMAT.md) by
    ``<m>.weight = q * scale`` in float32; the model casts it to its dtype like any weight."""
    for name in [n for n in tensors if n.endswith(INT8_SUFFIX)]:
        module = name.removesuffix(INT8_SUFFIX)
        q, scale = tensors.pop(name), tensors.pop(module + SCALE_SUFFIX, None)
        if scale is None or q.dtype != torch.int8 or scale.shape != q.shape[:1]:
            raise ValueError(
                f"{model_dir}: {name} needs an int8 [rows, cols] tensor and a [rows] {module}{SCALE_SUFFIX};"
                f" got {q.dtype} {list(q.shape)} and {None if scale is None else list(scale.shape)}: re-export it"
            )
        tensors[module + ".weight"] = q.float() * scale.float()[:, None]
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
