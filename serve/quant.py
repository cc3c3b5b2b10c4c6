"""GPTQ 4-bit checkpoints: the format reference and the CPU int4 runtime.

Checkpoint format (GPTQ v1, as AutoGPTQ / gptqmodel / transformers / vLLM read it), per linear
with K input and N output features:
- `qweight` int32 [K/8, N]: eight 4-bit values packed along the *input* dim, lowest nibble first;
- `qzeros`  int32 [G, N/8]: packed along the *output* dim, storing zero - 1 (v1; v2 stores zero);
- `scales`  fp16  [G, N];  `g_idx` int32 [K]: the group of each input feature;
- w[i, o] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o]).

Runtime: torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) computes
w = (q - 8) * scale + zero' with groups of contiguous input features. Rewriting GPTQ's form,
scale * (q - zero) = (q - 8) * scale + scale * (8 - zero), so zero' = scale * (8 - zero).
Act-order checkpoints (g_idx not sorted) are served by permuting input features so each group
becomes contiguous; the activations are permuted the same way at run time. The kernel wants
bf16 activations (fp32 is far slower, docs/precision.md), so it always runs in bf16. Where serve's own AVX2
kernels build, int4 linears run on them instead, from the weight in their layout (`KERNELS.md`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve import cpu_kernels, hugepages
from serve.cpu import UPCAST_MIN_ROWS, upcast_bf16_default

KERNEL_GROUP_SIZES = (256, 128, 64, 32)
PACKED_MAX_ROWS = 128  # float32 oneDNN-packed path of DenseLinear (measured: MKL is as fast above)
F32_KERNEL_MAX_ROWS = 6  # float32 weights: serve's AVX2 kernel up to here (oneDNN wins from 8 rows)
# bf16 weights on a native-bf16 CPU: serve's kernel up to here, oneDNN's prepacked (AMX) GEMM above
# (the crossover `python -m benchmarks.isa_gemv` finds on Gemma 3 270M's shapes; docs/results.md).
NATIVE_BF16_KERNEL_MAX_ROWS = 4
# bf16 weights on an avx512_bf16 CPU (not amx): serve's small-batch GEMM (csrc/gemm_bf16.cpp) from
# there up to here, oneDNN's prepacked GEMM above. Gemma 3 270M's 18 layers from DRAM on Zen 4, 2
# threads: 8 rows 6.5 ms against 8.7, 33 rows 17.4 against 20.2, 128 rows 66.2 against 69.4, 256
# rows 127.3 against 121.1 (`python -m benchmarks.isa_gemv --gemm`; docs/results.md). On an amx CPU
# the tile GEMMs win from 5 rows (Xeon, 2 threads: 5 rows 10.0 ms against 11.4, 33 rows 13.9
# against 38.8), so it takes none.
NATIVE_BF16_GEMM_MAX_ROWS = 128
# rows a bf16 weight is prepacked for. oneDNN picks the blocked layout by this hint: 1 gives a
# GEMV layout (AB16b64a2b) that the AMX kernel runs at about half speed for 8-512 rows (the LM
# head of Gemma 3 at 32-48 rows: 45-50 ms against 24-35 ms); any hint from 16 up gives the same
# AB16b32a2b layout. Batch-1 decode does not read it (serve's kernel takes up to 4 rows).
BF16_PACK_BATCH_HINT = 64
# bf16 weights where serve's kernels run their amx variant: AMX tile GEMMs (csrc/amx.cpp) take every
# batch past the one-row kernel's rows, in place of oneDNN's prepacked copy (never both: one copy)


def unpack_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K/8, N] -> int32 [K, N] values 0..15 (input feature 8r+j is nibble j of row r)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF
    return q.reshape(qweight.shape[0] * 8, qweight.shape[1])


def unpack_qzeros(qzeros: torch.Tensor, checkpoint_format: str = "gptq") -> torch.Tensor:
    """int32 [G, N/8] -> int32 [G, N] zero points, undoing v1's stored (zero - 1)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    z = (qzeros[:, :, None] >> shifts[None, None, :]) & 0xF
    z = z.reshape(qzeros.shape[0], qzeros.shape[1] * 8)
    return z + 1 if checkpoint_format == "gptq" else z


def default_g_idx(in_features: int, group_size: int) -> torch.Tensor:
    """g_idx of a checkpoint without act-order (group_size -1 means one group)."""
    size = in_features if group_size <= 0 else group_size
    return torch.arange(in_features, dtype=torch.int32) // size


def gptq_dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    checkpoint_format: str = "gptq",
) -> torch.Tensor:
    """Reference dequantization to a float32 weight [N, K] (nn.Linear layout)."""
    q = unpack_qweight(qweight).float()
    zeros = unpack_qzeros(qzeros, checkpoint_format).float()
    g = g_idx.long()
    return (scales.float()[g] * (q - zeros[g])).T.contiguous()


@dataclass
class Int4Parts:
    """A GPTQ linear in the kernel's terms, before packing; parts can be fused along N."""

    q: torch.Tensor  # int32 [K, N], input features in kernel order
    scales: torch.Tensor  # float32 [K/kg, N]
    zeros: torch.Tensor  # float32 [K/kg, N], the kernel's zero' = scale * (8 - zero)
    perm: torch.Tensor | None  # input permutation (act-order) or None
    kernel_group: int


def _kernel_group(group_size: int, in_features: int) -> int:
    """Largest kernel group size dividing the GPTQ group; finer groups just repeat scales."""
    for kg in KERNEL_GROUP_SIZES:
        if group_size % kg == 0 and in_features % kg == 0:
            return kg
    raise ValueError(
        f"GPTQ group size {group_size} with in_features {in_features} is not served: the CPU int4 "
        f"kernel needs a group size that is a multiple of one of {KERNEL_GROUP_SIZES}"
    )


def gptq_to_int4_parts(
    name: str,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    checkpoint_format: str = "gptq",
) -> Int4Parts:
    """Translate one GPTQ linear (named `name` for errors) into kernel order and zero form."""
    q = unpack_qweight(qweight)
    in_features = q.shape[0]
    size = in_features if group_size <= 0 else group_size
    g = (default_g_idx(in_features, size) if g_idx is None else g_idx).long()
    perm = torch.argsort(g, stable=True)
    g_sorted = g[perm]
    if not torch.equal(g_sorted, torch.arange(in_features) // size):
        raise ValueError(
            f"{name}.g_idx does not assign exactly {size} input features to each group; the checkpoint is malformed"
        )
    zeros = unpack_qzeros(qzeros, checkpoint_format).float()
    sc = scales.float()
    kg = _kernel_group(size, in_features)
    repeat = size // kg
    identity = torch.equal(perm, torch.arange(in_features))
    return Int4Parts(
        q=q if identity else q[perm],
        scales=sc.repeat_interleave(repeat, 0),
        zeros=(sc * (8 - zeros)).repeat_interleave(repeat, 0),
        perm=None if identity else perm,
        kernel_group=kg,
    )


def can_fuse(parts: list[Int4Parts]) -> bool:
    """Parts share one input permutation and kernel group, so one matmul can serve them all."""
    first = parts[0]
    for p in parts[1:]:
        if p.kernel_group != first.kernel_group:
            return False
        if (p.perm is None) != (first.perm is None):
            return False
        if p.perm is not None and not torch.equal(p.perm, first.perm):
            return False
    return True


class Int4Linear:
    """y = x W^T (+ b) with W held as packed int4: serve's AVX2 kernels, else torch's CPU kernel.

    serve's kernels (`cpu_kernels`) beat torch's int4 kernel at every batch size measured (see
    serve/KERNELS.md), so where they build they serve every call, prefill included. That also keeps
    the arithmetic of a row independent of how many rows share its forward: a speculative
    verification chunk then computes exactly what plain decoding would, and greedy outputs stay
    identical with and without a draft (with int8 activations on small batches only, a batch-8
    validation run diverged on one request).
    """

    def __init__(
        self,
        parts: list[Int4Parts],
        bias: torch.Tensor | None = None,
        use_kernels: bool | None = None,
        int8_activations: bool = True,
    ) -> None:
        if not can_fuse(parts):
            raise ValueError("Int4Linear: parts with different act-order permutations cannot be fused")
        q = torch.cat([p.q for p in parts], dim=1)
        self.in_features, self.out_features = q.shape
        self.kernel_group = parts[0].kernel_group
        self.perm = parts[0].perm
        scales = torch.cat([p.scales for p in parts], dim=1)
        zeros = torch.cat([p.zeros for p in parts], dim=1)
        self.bias = bias
        self.int8_activations = int8_activations
        use = cpu_kernels.available() if use_kernels is None else use_kernels
        fits = cpu_kernels.Int4Packed.fits(self.in_features, self.kernel_group)
        self.avx2 = cpu_kernels.Int4Packed(q, scales, zeros, self.kernel_group) if use and fits else None
        if self.avx2 is None:  # torch's kernel: bf16 activations, bf16 scales and zeros
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.T.contiguous().to(torch.int32), 1)
            self.scales_and_zeros = torch.stack([scales, zeros], dim=-1).to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Apply to x [..., K] of any float dtype; returns x's dtype."""
        flat = x.dim() == 2  # decode rows arrive flat: no reshape round trip (two ops per call)
        x2 = x if flat else x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if self.avx2 is not None:
            y = cpu_kernels.gemv_int4(x2, self.avx2, x.dtype, self.int8_activations)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(torch.bfloat16), self.packed, self.kernel_group, self.scales_and_zeros
            ).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y if flat else y.reshape(*x.shape[:-1], self.out_features)


def _mkldnn_pack(weight: torch.Tensor, allow_float32: bool = False, batch_hint: int = 1) -> torch.Tensor | None:
    """oneDNN's blocked copy of a bf16 CPU weight, or None where that path does not apply.

    Why: a plain bf16 `F.linear` on CPU reorders the weight into oneDNN's blocked layout on every
    call. For small batches that copy costs more than the matmul (an LM head took longer per decode
    step than prepacked), with bit-identical results (the same
    oneDNN kernel runs, only the reorder is hoisted to load time). `allow_float32` packs a
    float32 weight too: float32 models and the upcast path of bf16 ones (`DenseLinear`), where
    oneDNN's small-batch kernel beats MKL's for 2-128 rows (decode batches, verification
    chunks). Float32 results then differ from MKL's (transformers') in summation order only;
    vLLM's CPU backend packs its float32 weights for oneDNN the same way.
    """
    dtypes = (torch.bfloat16, torch.float32) if allow_float32 else (torch.bfloat16,)
    if weight.dtype not in dtypes or weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        probe = torch.ones(1, weight.shape[1], dtype=weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        ref = torch.nn.functional.linear(probe, weight)
        ok = torch.equal(got, ref) if weight.dtype == torch.bfloat16 else torch.allclose(got, ref, rtol=1e-4, atol=1e-5)
    except (RuntimeError, AttributeError):  # a torch build without these oneDNN ops
        return None
    return packed if ok else None


class DenseLinear:
    """y = x W^T (+ b) for a plain weight, callable like Int4Linear.

    bf16 on CPU runs prepacked where oneDNN can. On a CPU without native bf16 (`serve.cpu`):
    up to cpu_kernels.MAX_ROWS rows (decode steps, verification) go through serve's AVX2 kernel
    on the bf16 weight itself (widened in registers, float32 accumulation, one bf16 rounding);
    larger batches use a float32 copy of the weight (oneDNN-prepacked up to PACKED_MAX_ROWS
    rows, MKL above), computed the same way. The copy costs twice the bf16 weight's memory and makes
    prefill several times faster there. On a CPU with native bf16 the weight stays oneDNN-prepacked, but up
    to NATIVE_BF16_KERNEL_MAX_ROWS rows go through serve's kernel when it runs its avx512_bf16
    variant (bf16 x bf16 with vdpbf16ps; same float32 accumulation and single rounding), and
    where it runs its amx variant every larger batch takes serve's AMX tile GEMM on a tile-ordered
    copy instead of oneDNN's (`cpu_kernels.amx_linear`; float32 sums, the bias, one rounding).
    A float32 weight runs serve's AVX2 kernel for up to
    F32_KERNEL_MAX_ROWS rows (oneDNN's fixed per-call cost exceeds a small layer's whole product
    there) and is oneDNN-prepacked up to PACKED_MAX_ROWS rows (MKL above), as vLLM's CPU backend
    does. `upcast=None` decides by the
    hardware and `use_kernels=None` by whether the kernels built; True/False force them (tests).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        upcast: bool | None = None,
        use_kernels: bool | None = None,
        prepack: bool = True,
    ) -> None:
        """`prepack=False` skips oneDNN's bf16 copy (a caller that only sends decode-sized batches)."""
        self.weight = hugepages.place(weight.contiguous())  # what decode rows stream (serve.hugepages)
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        use = cpu_kernels.available() if use_kernels is None else use_kernels
        self.amx = cpu_kernels.amx_pack(self.weight) if prepack and use and cpu_kernels.amx_fits(self.weight) else None
        self.packed = None
        if prepack and self.amx is None:
            self.packed = _mkldnn_pack(self.weight, batch_hint=BF16_PACK_BATCH_HINT)
        is_f32 = weight.dtype == torch.float32
        self.packed_f32 = _mkldnn_pack(self.weight, allow_float32=True, batch_hint=5) if is_f32 else None
        if upcast is None:
            upcast = upcast_bf16_default(weight.dtype, weight.device)
        upcast = upcast and weight.dtype == torch.bfloat16
        self.weight32 = self.weight.float() if upcast else None
        native = use and not upcast and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
        native = native and cpu_kernels.has_bf16_dot()  # the widening AVX2 kernel lost to oneDNN here
        self.bias32 = bias.float() if (upcast or native) and bias is not None else None
        self.packed32 = _mkldnn_pack(self.weight32, allow_float32=True, batch_hint=5) if upcast else None
        self.upcast_min_rows = UPCAST_MIN_ROWS
        self.kernel_max_rows = cpu_kernels.MAX_ROWS if upcast and use else 0
        if native:
            self.kernel_max_rows = NATIVE_BF16_KERNEL_MAX_ROWS
        # amx: its tile GEMMs (or oneDNN's, for a shape the tiles do not take) beat this one from 5 rows
        self.gemm_max_rows = NATIVE_BF16_GEMM_MAX_ROWS if native and not cpu_kernels.has_amx() else 0
        on_cpu = weight.device.type == "cpu"
        self.f32_kernel_max_rows = F32_KERNEL_MAX_ROWS if is_f32 and on_cpu and use else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """F.linear in the weight's dtype (float32 compute or the prepacked weight where they apply)."""
        rows = x.numel() // self.in_features
        if rows == 0:  # a forward that samples no row: no kernel (CPU-only ones included) sees it
            return x.new_empty(*x.shape[:-1], self.out_features)
        if x.dtype == torch.bfloat16 and rows <= self.kernel_max_rows:
            return self._kernel(x, rows)
        if x.dtype == torch.bfloat16 and rows <= self.gemm_max_rows:
            x2 = x if x.dim() == 2 else x.reshape(rows, self.in_features)
            y = cpu_kernels.gemm_bf16_rows(x2.contiguous(), self.weight, self.bias32)
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)
        if self.weight32 is not None and x.dtype == torch.bfloat16 and rows >= self.upcast_min_rows:
            return self._upcast(x, rows)
        if x.dtype == torch.float32 and rows <= self.f32_kernel_max_rows:
            return self._kernel_f32(x, rows)
        if self.packed_f32 is not None and x.dtype == torch.float32 and rows <= PACKED_MAX_ROWS:
            x2 = x if x.dim() == 2 else x.reshape(rows, self.in_features)
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed_f32, self.bias, "none", [], "")
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)
        if self.amx is not None and x.dtype == torch.bfloat16:
            x2 = x if x.dim() == 2 else x.reshape(rows, self.in_features)
            y = cpu_kernels.amx_linear(x2, self.amx, self.bias)
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)
        if self.packed is not None and x.dtype == torch.bfloat16 and x.dim() == 2:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def _kernel(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """serve's kernel on the bf16 weight; the bias joins in float32 before the single bf16 rounding."""
        x2 = x if x.dim() == 2 else x.reshape(rows, self.in_features)
        if self.bias32 is None:
            y = cpu_kernels.gemv_bf16(x2, self.weight, torch.bfloat16)
        else:
            y = (cpu_kernels.gemv_bf16(x2, self.weight, torch.float32) + self.bias32).to(torch.bfloat16)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def _kernel_f32(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """serve's AVX2 kernel on the float32 weight in place (decode-sized batches)."""
        x2 = x if x.dim() == 2 else x.reshape(rows, self.in_features)
        y = cpu_kernels.gemv_f32(x2, self.weight, torch.float32)
        if self.bias is not None:
            y = y + self.bias
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def _upcast(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The float32 copy of the weight: oneDNN-prepacked for small batches, MKL above."""
        if self.packed32 is not None and rows <= PACKED_MAX_ROWS:
            y = torch.ops.mkldnn._linear_pointwise(
                x.reshape(rows, -1).float(), self.packed32, self.bias32, "none", [], ""
            )
            return y.to(torch.bfloat16).reshape(*x.shape[:-1], self.out_features)
        return torch.nn.functional.linear(x.float(), self.weight32, self.bias32).to(torch.bfloat16)
