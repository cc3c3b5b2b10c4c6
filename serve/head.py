"""The LM head of a bf16 model on a native-bf16 CPU: float32 logits by vocabulary slices into a reused buffer.

Why: on a model with a large vocabulary (Gemma 3: 262k rows, 278k after extension) the logits of
a decode batch are tens of megabytes. Computed as one bf16 matrix and widened with `.float()`,
every step allocated two fresh buffers of that size, and the page faults on that memory cost
more than the widening itself (40 rows: 16 ms for `.float()` into fresh memory against 2 ms into
memory already touched). Here the head runs as vocabulary slices, each prepacked for oneDNN once,
and each slice's bf16 output (a few MiB, which the allocator reuses) is widened into a float32
buffer the engine keeps from step to step. The numbers are those of one GEMM over the whole head
rounded to bf16 and widened, as before: a slice only cuts the output columns, never the reduction.

Decode-sized batches (up to `HEAD_KERNEL_MAX_ROWS`) take serve's kernel over the whole
head, as `DenseLinear` does, with its float32 sums rounded through bf16 in place in the buffer
(`cpu_kernels.gemv_bf16_out`): a bf16 result, a widened copy and a copy into the buffer cost
about 0.3 ms of a 20 ms decode step on Gemma 3's 262k-row head. Where serve's kernels run
their amx variant, larger batches take its AMX tile GEMM over the whole head instead of the
slices, writing the same numbers (float32 sums rounded once to bf16, widened) straight into the
buffer: no slice outputs, no copies.
"""

from __future__ import annotations

import torch

from serve import cpu_kernels
from serve.quant import DenseLinear

SLICE_ROWS = 32768  # vocabulary rows per prepacked slice: its bf16 output for 64 rows is 4 MiB
# rows of a bf16 head serve's kernel takes on a native-bf16 CPU (linears: 4). Gemma 3's head on Zen 4,
# best of 3 x 10: 5 rows 7.2 ms against 9.5 for oneDNN's slices, 8 rows 9.8 against 13.2, 12 rows
# 17.0 against 15.5. Speculative verification (k + 1 rows) and small greedy batches are screened up
# to here (serve.head_screen)
HEAD_KERNEL_MAX_ROWS = 8


class LogitsBuffer:
    """One float32 buffer grown to the largest [rows, vocab] asked for, handed out as views.

    A view is valid until the next `take`: the engine consumes a step's logits (sampling,
    verification) before the model's next forward.
    """

    def __init__(self) -> None:
        self._data = torch.empty(0)

    def take(self, rows: int, vocab: int) -> torch.Tensor:
        """A [rows, vocab] float32 view over the buffer (its contents are stale)."""
        if self._data.numel() < rows * vocab:
            self._data = torch.empty(rows * vocab)
        return self._data[: rows * vocab].view(rows, vocab)


class SlicedHead:
    """y = x W^T for bf16 rows and a bf16 CPU weight, returned in float32 (see the module doc)."""

    def __init__(self, weight: torch.Tensor, slice_rows: int = SLICE_ROWS) -> None:
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            raise ValueError(f"SlicedHead takes a bf16 CPU weight, got {weight.dtype} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.whole = DenseLinear(weight, upcast=False, prepack=False)  # decode rows: serve's kernel
        if self.whole.kernel_max_rows:  # the head streams 335 MB: the kernel wins at more rows than a linear
            self.whole.kernel_max_rows = HEAD_KERNEL_MAX_ROWS
        # AMX tiles write the whole head's float32 logits in place; oneDNN runs by slices
        self.amx = cpu_kernels.amx_pack(weight) if cpu_kernels.amx_fits(weight) else None
        self.bounds = [(a, min(a + slice_rows, self.out_features)) for a in range(0, self.out_features, slice_rows)]
        self.slices = [] if self.amx is not None else [DenseLinear(weight[a:b], upcast=False) for a, b in self.bounds]

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [rows, V] of bf16 rows x [rows, H], written into `out` when given."""
        rows = x.shape[0]
        out = torch.empty(rows, self.out_features) if out is None else out
        if rows <= self.whole.kernel_max_rows:  # decode rows: serve's kernel straight into `out`
            return cpu_kernels.gemv_bf16_out(x.reshape(rows, self.in_features), self.whole.weight, out)
        if self.amx is not None:
            return cpu_kernels.amx_linear(x, self.amx, out=out)
        for (a, b), part in zip(self.bounds, self.slices):
            out[:, a:b].copy_(part(x))
        return out
