"""Torch reference dequantization of Warsha's GPTQ and AWQ-GEMM checkpoints (FORMAT.md).

Two uses: perplexity evaluation of a quantized artifact (load it back as a plain HF model), and
the reference the serve engine's int4 paths are tested against. It deliberately shares no code
with ``quantize.pack``: it reads the format as FORMAT.md states it, by expanding every int32 into
its 32 bits, so a packing bug cannot hide behind a matching unpacking bug.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _bits_of(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., k]`` -> 0/1 int64 ``[..., k*32]``, least significant bit first."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    bits = (w[..., None] >> torch.arange(32, dtype=torch.int64)) & 1
    return bits.reshape(*words.shape[:-1], words.shape[-1] * 32)


def _values_from_stream(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Read ``count`` little-endian ``bits``-bit values from each row's bit stream."""
    stream = _bits_of(words)[..., : count * bits].reshape(*words.shape[:-1], count, bits)
    weights = 2 ** torch.arange(bits, dtype=torch.int64)
    return (stream * weights).sum(-1)


def gptq_weight(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int
) -> torch.Tensor:
    """Float32 ``W[out, in]`` from GPTQ v1 tensors: ``(q - (stored_zero + 1)) * scale[g_idx]``."""
    n_groups, out_f = scales.shape
    in_f = g_idx.shape[0]
    codes = _values_from_stream(qweight.t().contiguous(), bits, in_f)  # [out, in]
    zeros = _values_from_stream(qzeros, bits, out_f) + 1  # [G, out]
    g = g_idx.long()
    return (codes - zeros.t()[:, g]).float() * scales.float().t()[:, g]


def awq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Float32 ``W[out, in]`` from AWQ-GEMM tensors: ``(q - zero) * scale`` per group."""
    codes = _awq_unpack(qweight)  # [in, out]
    zeros = _awq_unpack(qzeros)  # [G, out]
    g = torch.arange(codes.shape[0]) // group_size
    return ((codes - zeros[g]).float() * scales.float()[g]).t().contiguous()


def _awq_unpack(words: torch.Tensor) -> torch.Tensor:
    nibbles = _values_from_stream(words.reshape(-1, 1), 4, 8).reshape(*words.shape, 8)
    out = torch.empty_like(nibbles)
    out[..., list(AWQ_ORDER)] = nibbles  # nibble i holds column AWQ_ORDER[i]
    return out.reshape(words.shape[0], words.shape[1] * 8)


def int8_rows_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An ``embedding_bits: 8`` tensor back in float32: row r is ``q[r] * scale[r]``."""
    return q.float() * scale.float()[:, None]


def dequantize_state_dict(
    tensors: dict[str, torch.Tensor], qconfig: dict[str, Any], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Replace every ``<linear>.qweight/qzeros/scales[/g_idx]`` family, and every int8-row
    ``<module>.weight_int8/weight_scale`` pair, by ``<module>.weight``."""
    method = qconfig.get("quant_method")
    if method not in ("gptq", "awq"):
        raise ValueError(f"dequant: quant_method {method!r} is not one of 'gptq', 'awq'")
    if method == "gptq" and qconfig.get("checkpoint_format", "gptq") != "gptq":
        raise ValueError(f"dequant: only checkpoint_format 'gptq' (v1) is read, got {qconfig['checkpoint_format']!r}")
    if method == "awq" and qconfig.get("version", "gemm").lower() != "gemm":
        raise ValueError(f"dequant: only the AWQ 'gemm' version is read, got {qconfig['version']!r}")
    bits = int(qconfig["bits"])
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith((".qzeros", ".scales", ".g_idx", ".weight_scale")):
            continue
        if name.endswith(".weight_int8"):
            base = name.removesuffix(".weight_int8")
            out[f"{base}.weight"] = int8_rows_weight(t, tensors[f"{base}.weight_scale"]).to(dtype)
            continue
        if not name.endswith(".qweight"):
            out[name] = t
            continue
        base = name[: -len(".qweight")]
        if method == "gptq":
            w = gptq_weight(t, tensors[f"{base}.qzeros"], tensors[f"{base}.scales"], tensors[f"{base}.g_idx"], bits)
        else:
            w = awq_weight(t, tensors[f"{base}.qzeros"], tensors[f"{base}.scales"], int(qconfig["group_size"]))
        out[f"{base}.weight"] = w.to(dtype)
    return out


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"dequant: no .safetensors file in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def load_dequantized(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """A plain transformers model (no quantization_config) rebuilt from a quantized directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    qconfig = raw.get("quantization_config")
    if not qconfig:
        raise ValueError(f"dequant: {model_dir}/config.json has no quantization_config")
    config = AutoConfig.from_pretrained(model_dir)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = dequantize_state_dict(read_safetensors(model_dir), qconfig, dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"dequant: {model_dir}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
