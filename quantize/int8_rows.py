"""8-bit embedding and LM head in quantized exports (``embedding_bits: 8``).

Why: GPTQ and AWQ quantize the decoder's linears only, so a small model's export is dominated by
what they leave: Gemma 3 270M's tied 262k-row (278k once extended) x 640 embedding is 356 MB of
its 4-bit export in bfloat16, where llama.cpp's Q4_K_M keeps it in 6 bits. Each row in int8 with
one float32 scale (``w ~ q * scale``, ``|q| <= 127``, round to nearest; the rounding serve uses
for ``head_quant: int8``) halves those bytes and moves each weight by at most half a step of its
row. The layout (FORMAT.md): ``<module>.weight_int8`` int8 ``[rows, cols]`` and
``<module>.weight_scale`` float32 ``[rows]`` in place of ``<module>.weight``. serve loads it;
vLLM, transformers and GPTQModel do not (they expect ``<module>.weight``), so it is opt-in.
"""

from __future__ import annotations

from typing import Any

import torch

from serve.head_quant import quantize_rows_int8

INT8_SUFFIX = ".weight_int8"
SCALE_SUFFIX = ".weight_scale"


def embedding_names(model: Any) -> list[str]:
    """State-dict names of the input embedding and, when it is not tied to it, the LM head."""
    wanted = [model.get_input_embeddings()]
    head = model.get_output_embeddings()
    if head is not None and head.weight is not wanted[0].weight:
        wanted.append(head)
    names = [f"{name}.weight" for name, module in model.named_modules() if any(module is w for w in wanted)]
    if len(names) != len(wanted):
        raise ValueError(f"quantize: could not name the embedding modules of {type(model).__name__}")
    return names


def int8_row_tensors(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The two tensors that replace ``<module>.weight`` (`name`) in the export."""
    q, scale = quantize_rows_int8(weight)
    module = name.removesuffix(".weight")
    return {module + INT8_SUFFIX: q, module + SCALE_SUFFIX: scale.float()}


def fake_quantize_embeddings(model: Any) -> None:
    """Round the embedding (and an untied head) in place to what the 8-bit export stores, so an
    in-memory reference (the RTN comparison) is scored with the same embedding as the export."""
    state = model.state_dict()
    with torch.no_grad():
        for name in embedding_names(model):
            w = state[name]
            q, scale = quantize_rows_int8(w)
            w.copy_(q.float() * scale[:, None])
