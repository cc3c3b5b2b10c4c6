"""AWQ-GEMM checkpoints (`quant_method: awq`, `version: gemm`), served as GPTQ v2 words.

AutoAWQ's GEMM layout packs eight 4-bit values per int32 along the *output* features, in the
nibble order `AWQ_ORDER` (nibble i holds column AWQ_ORDER[i] of its eight), for both `qweight`
[K, N/8] and `qzeros` [G, N/8], and stores the zero itself; `scales` is [G, N]; groups are
contiguous (no g_idx). The weight is the same `scales * (q - zero)` as GPTQ's, so at load each
linear is repacked into GPTQ's words (qweight along the input features, qzeros along the output
features, zero stored as is: `checkpoint_format: gptq_v2`) and every int4 path (serve's CPU
kernels, torch's int4 kernel, the Triton GEMM) serves it unchanged. Layout:
`quantize/FORMAT.md`; tested against `quantize.dequant`, which reads it independently.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] in AWQ's nibble order -> int64 [R, C] values 0..15 in column order."""
    nibbles = (words.long()[..., None] >> _SHIFTS) & 0xF  # [R, C/8, 8]: nibble i
    out = torch.empty_like(nibbles)
    out[..., list(AWQ_ORDER)] = nibbles
    return out.reshape(words.shape[0], words.shape[1] * 8)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values (int64) as the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along_rows(values: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R/8, C], row 8r+j in nibble j of word r (GPTQ's qweight)."""
    r, c = values.shape
    return _to_int32((values.long().reshape(r // 8, 8, c) << _SHIFTS[None, :, None]).sum(1))


def pack_along_cols(values: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R, C/8], column 8c+j in nibble j of word c (GPTQ's qzeros)."""
    r, c = values.shape
    return _to_int32((values.long().reshape(r, c // 8, 8) << _SHIFTS).sum(-1))


def awq_to_gptq_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every AWQ linear of `state` (`<m>.qweight/qzeros/scales`) as GPTQ v2 tensors; the rest as is."""
    out = dict(state)
    for name in [n for n in state if n.endswith(".qweight")]:
        module = name.removesuffix(".qweight")
        zeros = state.get(f"{module}.qzeros")
        if zeros is None or state[name].dtype != torch.int32:
            raise ValueError(f"{module}: an AWQ linear needs int32 qweight and qzeros; the checkpoint is malformed")
        out[name] = pack_along_rows(unpack_awq(state[name]))
        out[f"{module}.qzeros"] = pack_along_cols(unpack_awq(zeros))
    return out
