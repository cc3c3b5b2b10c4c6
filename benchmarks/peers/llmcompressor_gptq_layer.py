"""Run llm-compressor's own GPTQ solver (``quantize_weight``) on one weight and Hessian.

Why: ``quant_bench.py`` compares whole models, where Warsha's and llm-compressor's GPTQ also
differ in what they feed the solver (Warsha measures each sequential step's Hessian after the
earlier steps were quantized, llm-compressor takes a decoder layer's Hessians from one pass).
This isolates the solver: given the same ``W``, ``H`` and group grid, act-order with static
groups must give the same quantized weight (``tests/quantize/test_quant_peers.py``).

Runs inside the peer venv (``benchmarks/peers/make_venv.sh``):

    /work/venvs/peers/bin/python benchmarks/peers/llmcompressor_gptq_layer.py IN.pt OUT.pt

``IN.pt`` (``torch.save``) holds ``weight`` float32 ``[out, in]``, ``hessian`` ``[in, in]``,
``scale`` ``[out, in/group]`` (the symmetric group grid, fixed before reordering, as
llm-compressor's observer fixes it), ``bits``, ``group_size``, ``damp``, ``actorder``
(``"static"`` or None). ``OUT.pt`` gets ``weight`` (the fake-quantized weight) and ``library``.
"""

from __future__ import annotations

import sys

import torch


def main() -> None:
    torch.set_num_threads(1)
    job = torch.load(sys.argv[1])
    import llmcompressor
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight

    args = QuantizationArgs(
        num_bits=job["bits"],
        type="int",
        symmetric=True,
        strategy="group",
        group_size=job["group_size"],
        actorder=job.get("actorder"),
    )
    scale = job["scale"].float()
    zero = torch.zeros_like(scale, dtype=torch.int8)
    q, _, fallback = quantize_weight(
        job["weight"].float()[None].clone(),
        job["hessian"].float()[None].clone(),
        scale[None],
        zero[None],
        None,
        args,
        percdamp=job.get("damp", 0.01),
    )
    torch.save(
        {"weight": q[0], "rtn_fallback": bool(fallback[0]), "library": f"llmcompressor {llmcompressor.__version__}"},
        sys.argv[2],
    )


if __name__ == "__main__":
    main()
