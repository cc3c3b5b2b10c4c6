"""The LM head in int8 (`head_quant="int8"`): one symmetric scale per vocabulary row.

Why: a 4-bit checkpoint keeps its LM head in 16 bits (GPTQ and AWQ quantize the decoder's
linears only), so on a small model the head is a large share of what a decode step reads: a
32k x 1024 bf16 head is 65 MB against 52 MB for all int4 linears of the hidden-1024 preset.
llama.cpp stores the head of a Q4_0 model in 6 bits by default for the same reason. Rounding
each row to int8 with its own scale halves those bytes and moves each weight by at most half a
step of its row (max|row| / 254). Opt-in, since greedy outputs may then differ from the
checkpoint's at near-ties.

Decode steps (up to `cpu_kernels.MAX_ROWS` rows) run serve's kernel on the int8 rows: widened
to float32 in registers (AVX2, AVX-512), or, on the 512-bit VNNI variants, against the activation
row rounded once to int16 (integer dot products: the head then streams at memory speed; the
rounding moves a logit by at most 1.5e-5 of the row's largest activation times the row's weights).
The row's scale is applied to the finished sum. Larger batches use a float32 copy of the
dequantized head, as bf16 heads do on this path, on the same rounded rows where the kernel rounds
them, so prefill keeps its GEMM speed and every batch size computes the same numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from serve import cpu_kernels, hugepages


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows and one float32 scale per row: w ~ q * scale, |q| <= 127, round to nearest."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class Int8Linear:
    """y = x (q * scale)^T for a bias-free head, callable like `DenseLinear`."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.device.type != "cpu":
            raise ValueError("head_quant='int8' runs on the CPU only; use head_quant='none' on GPUs")
        if not cpu_kernels.available():
            raise ValueError("head_quant='int8' needs serve's AVX2 kernels, which are not available here")
        self.out_features, self.in_features = weight.shape
        self.q, self.scale = (hugepages.place(t) for t in quantize_rows_int8(weight))  # streamed by decode rows
        self.dequantized = self.q.float() * self.scale[:, None]  # the GEMM path of large batches

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Logits in x's dtype: the kernel for decode-sized batches, a float32 GEMM above."""
        rows = x.numel() // self.in_features
        x2 = x.reshape(rows, self.in_features)
        if rows <= cpu_kernels.MAX_ROWS:
            y = cpu_kernels.gemv_int8(x2, self.q, self.scale, x.dtype)
        else:
            x32 = x2.float()
            if cpu_kernels.int8_rounds_activations(self.in_features):  # as the kernel reads them
                x32 = cpu_kernels.round_rows_int16(x32)
            y = F.linear(x32, self.dequantized).to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)
