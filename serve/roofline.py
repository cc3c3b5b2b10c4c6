"""The bandwidth roofline of batch-1 decode: bytes one step must read, and the read bandwidth to divide them by.

A batch-1 decode step reads every weight but the embedding table once (the embedding is one row
lookup) plus the KV cache of the context so far; on a CPU that is memory-bound, tokens/s cannot
exceed bandwidth / those bytes. `python -m benchmarks.serve_peers` divides each engine's decode rate by it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

EMBED_KEYS = ("model.embed_tokens.weight",)
UNREAD_SUFFIXES = (".g_idx",)  # GPTQ's group index: the engine repacks it away at load


def read_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of a float32 `sum` over a `gib` GiB tensor at `threads` threads (best of `repeats`)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
        x.sum()  # fault the pages in
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - start)
        return x.numel() * 4 / best
    finally:
        torch.set_num_threads(old)


def checkpoint_decode_bytes(model_dir: Path, elem_bytes: int | None = None) -> int:
    """Bytes of the checkpoint's tensors a decode step reads (all but the embedding table and g_idx).

    `elem_bytes` re-prices floating tensors at that width (an engine running a bf16 checkpoint in
    float32 reads 4 bytes per weight); None keeps the stored widths (GPTQ packs stay packed)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if name in EMBED_KEYS or name.endswith(UNREAD_SUFFIXES):
                    continue
                sl = st.get_slice(name)
                n = 1
                for d in sl.get_shape():
                    n *= d
                dtype = sl.get_dtype()
                width = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I8": 1, "U8": 1}[dtype]
                if elem_bytes is not None and dtype in ("F32", "F16", "BF16"):
                    width = elem_bytes
                total += n * width
    return total


def head_bytes_saved_int8(model_dir: Path) -> int:
    """Bytes a decode step stops reading when a 16-bit, untied LM head is served in int8 per row."""
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("tie_word_embeddings"):
        return 0  # the embedding table is not counted as read (EMBED_KEYS), so neither is a tied head
    vocab, hidden = int(cfg["vocab_size"]), int(cfg["hidden_size"])
    return vocab * hidden - 4 * vocab  # 2 -> 1 byte per weight, plus one float32 scale per row


def kv_bytes_per_token(model_dir: Path, elem_bytes: int) -> int:
    """K and V bytes one context token holds across all layers."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    return 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim * elem_bytes


def roofline(weight_bytes: int, kv_per_token: int, mean_context: float, bandwidth: float) -> dict[str, float]:
    """Bytes per step at the mean context of the run, and the tokens/s bound they imply."""
    step = weight_bytes + kv_per_token * mean_context
    return {"step_bytes": step, "bound_tok_s": bandwidth / step}
