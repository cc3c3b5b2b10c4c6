"""Small shared pieces of serve's Triton kernels: buffers, dot precision, checks, rounding.

Importing this module imports triton. It and the kernel modules (`triton_decode`,
`triton_prefill`, `triton_cache`, `serve.triton_int4`) are only imported once `get_backend`
chose the Triton backend (or a caller asked for the int4 GEMM), so `import serve` and the CPU
engine never load triton.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

HALF_DTYPES = (torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every kernel output and scratch buffer comes from here (uninitialised, like torch.empty).

    One allocation point lets tests poison every buffer with NaN and so prove that each element
    of an output was written by a kernel and no scratch value is read before it is written.
    """
    return torch.empty(shape, dtype=dtype, device=device)


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision for operands upcast to float32 from `dtype`.

    Every kernel upcasts its operands to float32 before `tl.dot` (bf16 dots are wrong under the
    interpreter, and float32 accumulation is what the torch reference does). For bf16/fp16
    sources tf32 loses nothing on the upcast values themselves (tf32 keeps 10 mantissa bits,
    bf16 has 7 and fp16 10) and runs on tensor cores; a float32 model asks for exact IEEE dots.
    """
    return "tf32" if dtype in HALF_DTYPES else "ieee"


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (tl.arange sizes must be powers of two)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def check_device(name: str, *tensors: torch.Tensor) -> torch.device:
    """All tensors on one device that Triton can run on here; returns it.

    CUDA runs compiled kernels; CPU tensors are only valid under the interpreter, and without it
    triton would fail deep inside its launcher with a message about drivers.
    """
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"{name}: tensors are on {device} and {t.device}; move them to one device")
    if device.type == "cpu" and not interpreting():
        raise ValueError(
            f"{name}: Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is first "
            "imported (tests do this in tests/conftest.py); on CPU use the torch backend instead"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: device {device.type!r} is not supported by the Triton kernels; use cuda")
    return device


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels take explicit strides for every dim but the last, which must be 1."""
    return x if x.stride(-1) == 1 else x.contiguous()


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 `x` converted to `dtype`, rounding to nearest even.

    bf16 is rounded by hand on the bits: the interpreter's own float32 -> bf16 cast truncates
    (and its "rtne" mode rounds ties away from zero), so its results would not match torch's.
    Compiled, this is a few integer ops in an epilogue. NaN stays NaN.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = tl.where(x == x, bits, 0x7FC00000)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(dtype)
    return y
