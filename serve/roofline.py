"""The bandwidth roofline of batch-1 decode: bytes one step must read, and the read bandwidth to divide them by.

A batch-1 decode step reads every weight once but the embedding table (one row lookup, unless the
checkpoint ties it to the LM head, which reads all of it) plus the KV cache of the context so
far; on a CPU that is memory-bound, tokens/s cannot exceed bandwidth / those bytes.
`python -m benchmarks.serve_peers` divides each engine's decode rate by it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

EMBED_PREFIX = "model.embed_tokens."  # .weight, or the .weight_int8/.weight_scale of an 8-bit export
HEAD_PREFIX = "lm_head."
UNREAD_SUFFIXES = (".g_idx",)  # GPTQ's group index: the engine repacks it away at load
WIDTHS = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I8": 1, "U8": 1}


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


def _tensor_widths(model_dir: Path) -> dict[str, tuple[int, str]]:
    """Element count and safetensors dtype of every tensor in the checkpoint."""
    from safetensors import safe_open

    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                n = 1
                for d in sl.get_shape():
                    n *= d
                out[name] = (n, sl.get_dtype())
    return out


def checkpoint_decode_bytes(model_dir: Path, elem_bytes: int | None = None) -> int:
    """Bytes of the checkpoint's tensors a decode step reads: all but g_idx, and the embedding table
    only when it is also the LM head (a tied checkpoint has no ``lm_head.*``; its head reads the
    whole table every step, where an embedding lookup reads one row).

    `elem_bytes` re-prices floating tensors at that width (an engine running a bf16 checkpoint in
    float32 reads 4 bytes per weight); None keeps the stored widths (GPTQ packs stay packed)."""
    tensors = _tensor_widths(model_dir)
    tied = not any(name.startswith(HEAD_PREFIX) for name in tensors)
    total = 0
    for name, (n, dtype) in tensors.items():
        if (name.startswith(EMBED_PREFIX) and not tied) or name.endswith(UNREAD_SUFFIXES):
            continue
        width = WIDTHS[dtype]
        if elem_bytes is not None and dtype in ("F32", "F16", "BF16"):
            width = elem_bytes
        total += n * width
    return total


def head_bytes_saved_int8(model_dir: Path) -> int:
    """Bytes a decode step stops reading when a 16-bit LM head (tied or not) is served in int8 per
    row; none when the checkpoint already stores it in int8 rows."""
    tensors = _tensor_widths(model_dir)
    head = [n for n in tensors if n.startswith(HEAD_PREFIX)] or [n for n in tensors if n.startswith(EMBED_PREFIX)]
    if any(n.endswith(".weight_int8") for n in head) or len(head) != 1:
        return 0
    rows_cols, _ = tensors[head[0]]
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    return rows_cols - 4 * vocab  # 2 -> 1 byte per weight, plus one float32 scale per row


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
