"""Writing the quantized model directory (the layout is specified in FORMAT.md).

Quantized linears are replaced by their packed tensors; every other tensor (embeddings, norms,
including AWQ-folded norms, lm_head) is written in the serving dtype the stage's ``save_dtype``
names (bfloat16 by default: what vLLM and serve run GPTQ/AWQ checkpoints in; a float32 input's
tied 278k-row embedding alone is 712 MB of the real recipe's export, 356 MB in bfloat16), or in
the input checkpoint's dtype with ``save_dtype: auto``; with ``embedding_bits: 8`` the embedding
and an untied head are int8 rows instead (``quantize.int8_rows``; serve loads them, other engines
do not), recorded as ``quantization_config.embedding_bits``.
``config.json`` is the input's plus ``quantization_config``; tokenizer files are copied, and so
are the files that say how the checkpoint is served (``SERVING_FILES``): a draft model's
``draft_vocab.json`` restricts its head to the ids it scores, and a quantized draft without it
would score all of the vocabulary again, most of the time its forward takes.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from quantize.int8_rows import embedding_names, int8_row_tensors
from quantize.pack import pack_awq, pack_gptq
from quantize.quantizer import QuantizedLinear
from warsha import tokenizer_files

SERVING_FILES = ("draft_vocab.json",)
SHARD_BYTES = 4 * 1024**3


def quantization_config(
    fmt: str, bits: int, group_size: int, sym: bool, skipped: list[str], extra: dict[str, Any]
) -> dict[str, Any]:
    """The ``quantization_config`` block transformers, vLLM and gptqmodel read."""
    if fmt == "gptq":
        qc: dict[str, Any] = {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group_size,
            "sym": sym,
            # desc_act tells loaders the groups follow a permutation (g_idx); act-order with static
            # groups rounds columns in that order but keeps group i // group_size, so the checkpoint
            # is a plain sequential one (vLLM 0.32 refuses desc_act: true outright)
            "desc_act": bool(extra.get("desc_act", False)) and not extra.get("static_groups", False),
            "checkpoint_format": "gptq",
            "lm_head": False,
        }
        qc.update({k: v for k, v in extra.items() if k != "desc_act"})
    else:
        qc = {"quant_method": "awq", "version": "gemm", "bits": bits, "group_size": group_size, "zero_point": not sym}
    if skipped:  # gptqmodel/vLLM "dynamic": a leading "-:" excludes matching modules (gptqmodel
        # ignores modules_to_not_convert, for AWQ too: without this it fails on the float linears)
        qc["dynamic"] = {f"-:^{re.escape(name)}$": {} for name in skipped}
    qc["modules_to_not_convert"] = list(skipped) or None
    qc["meta"] = {"quantizer": ["warsha:0.1.0"]}  # gptqmodel/transformers keep tool versions here
    return qc


def packed_state(
    model: Any,
    quantized: dict[str, QuantizedLinear],
    fmt: str,
    save_dtype: torch.dtype,
    embedding_bits: int = 16,
) -> dict[str, torch.Tensor]:
    """The tensors of the output checkpoint; with `embedding_bits` 8 the embedding (and an untied
    head) as int8 rows (``quantize.int8_rows``)."""
    state = model.state_dict()
    int8 = set(embedding_names(model)) if embedding_bits == 8 else set()
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        module, leaf = name.rsplit(".", 1)
        if module in quantized and leaf == "weight":
            continue
        if name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
            continue
        if name in int8:
            out.update(int8_row_tensors(name, t.detach().cpu()))
            continue
        out[name] = (t.to(save_dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
    pack = pack_gptq if fmt == "gptq" else pack_awq
    for module, ql in quantized.items():
        for suffix, t in pack(ql).items():
            out[f"{module}.{suffix}"] = t.contiguous()
    return out


def write_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path, shard_bytes: int = SHARD_BYTES) -> list[Path]:
    """One ``model.safetensors``, or shards plus ``model.safetensors.index.json`` when large."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    meta = {"format": "pt"}
    if len(shards) == 1:
        path = out_dir / "model.safetensors"
        save_file(shards[0], str(path), metadata=meta)
        return [path]
    paths, weight_map = [], {}
    for k, shard in enumerate(shards, 1):
        path = out_dir / f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path), metadata=meta)
        weight_map.update({name: path.name for name in shard})
        paths.append(path)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return paths


def source_dtype(src_dir: Path) -> torch.dtype:
    """The dtype the input checkpoint declares (float tensors are written back in it)."""
    raw = json.loads((Path(src_dir) / "config.json").read_text())
    name = str(raw.get("dtype") or raw.get("torch_dtype") or "float32")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)


def save_dtype(name: str, src_dir: Path) -> torch.dtype:
    """The dtype the export's float tensors are written in: ``auto`` keeps the input's."""
    if name == "auto":
        return source_dtype(src_dir)
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def export(
    model: Any,
    quantized: dict[str, QuantizedLinear],
    src_dir: Path,
    out_dir: Path,
    qconfig: dict[str, Any],
    dtype: torch.dtype | None = None,
    embedding_bits: int = 16,
) -> None:
    """Write the whole output directory; float tensors in ``dtype`` (default: the input's), the
    embedding in int8 rows when `embedding_bits` is 8.

    ``config.json`` declares the dtype written, so loaders that follow it (transformers'
    ``dtype="auto"``, vLLM) load the checkpoint in that dtype.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = dtype or source_dtype(src_dir)
    write_safetensors(packed_state(model, quantized, qconfig["quant_method"], dtype, embedding_bits), out_dir)
    raw = json.loads((Path(src_dir) / "config.json").read_text())
    raw["quantization_config"] = qconfig if embedding_bits == 16 else dict(qconfig, embedding_bits=embedding_bits)
    raw.pop("torch_dtype", None)
    raw["dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    copy_side_files(Path(src_dir), out_dir)


def copy_side_files(src_dir: Path, out_dir: Path) -> list[str]:
    """Copy the tokenizer, chat setup (``warsha.tokenizer_files``) and serving files of `src_dir`
    into `out_dir`; their names."""
    copied = tokenizer_files.copy_tokenizer(src_dir, out_dir)
    for f in tokenizer_files.matching(src_dir, SERVING_FILES):
        shutil.copy2(f, out_dir / f.name)
        copied.append(f.name)
    return sorted(copied)
