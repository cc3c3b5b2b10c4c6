"""Serve's own AVX2 kernels (`csrc/`): build, load, the int4 layout and short-chunk paged attention.

Why: a decode step reads every weight once for a handful of activation rows. On an AVX2-only
CPU torch's bf16 matrix-vector product and its int4 kernel are bound by their own arithmetic,
not by memory (see the C++ file's header for the measurements); these kernels widen each weight
block once and reuse it for up to 8 rows. They are compiled on first use with torch's C++
extension builder (g++ and ninja; about a minute, cached under TORCH_EXTENSIONS_DIR) and used
for up to `MAX_ROWS` rows: decode steps and speculative verification. `csrc/attention_avx2.cpp`
attends short query chunks (the same steps) straight from the paged cache; `csrc/rope_kv.cpp`
rotates the new queries and keys and writes K/V into the cache in one call per layer. Without a compiler, on a
CPU without AVX2+FMA, or with WARSHA_SERVE_CPU_KERNELS=0, the engine keeps torch's kernels and
says so once in the log.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("serve.cpu_kernels")

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("gemv_avx2.cpp", "attention_avx2.cpp", "rope_kv.cpp", "bindings.cpp"))
HEADERS = (CSRC / "bf16.h",)
MAX_ROWS = 16  # beyond this, oneDNN/MKL GEMMs and torch's int4 kernel win (they block over rows)
BLOCK = 32  # input features per int4 block of the packed layout
ENV_SWITCH = "WARSHA_SERVE_CPU_KERNELS"
# -fopenmp: at::parallel_for is an OpenMP pragma in torch's headers; without the flag the kernels
# silently run on one thread. The runtime loaded is torch's own libgomp (same soname).
# -ffp-contract=off: products and sums round as torch's separate ops do (RoPE must match torch
# bit for bit); the kernels' FMAs are explicit intrinsics, which the flag leaves alone.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"]
LDFLAGS = ["-fopenmp"]
STALE_LOCK_SECONDS = 600.0


def _cpu_has_avx2() -> bool:
    """AVX2 and FMA present (torch's own dispatch level says AVX2 or better)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability in ("AVX2", "AVX512", "AVX512_BF16", "AMX") or capability.startswith("AVX512")


@functools.lru_cache(maxsize=1)
def load() -> ModuleType | None:
    """The compiled extension, or None (and one log line naming why) where it cannot run."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        log.info("%s=0: using torch's CPU kernels for small batches", ENV_SWITCH)
        return None
    if not _cpu_has_avx2():
        log.warning(
            "CPU lacks AVX2/FMA (torch reports %s): using torch's CPU kernels", torch.backends.cpu.get_cpu_capability()
        )
        return None
    try:
        from torch.utils import cpp_extension

        # named by the hash of source and flags: checkouts of different versions never rebuild
        # each other's library (nor replace it under a running process); the same source builds once
        text = b"".join(src.read_bytes() for src in SOURCES + HEADERS)
        digest = hashlib.sha256(text + " ".join(CFLAGS + LDFLAGS).encode()).hexdigest()[:12]
        name = f"warsha_serve_gemv_avx2_{digest}"
        clear_stale_lock(Path(cpp_extension._get_build_directory(name, verbose=False)))
        return cpp_extension.load(
            name=name,
            sources=[str(src) for src in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            verbose=False,
        )
    except Exception as err:  # noqa: BLE001 - any build failure means: fall back, loudly
        log.warning(
            "could not build serve's AVX2 kernels (%s: %s); using torch's CPU kernels, which are slower here",
            type(err).__name__,
            str(err).splitlines()[0] if str(err) else "",
        )
        return None


def clear_stale_lock(build_dir: Path, max_age: float = STALE_LOCK_SECONDS) -> bool:
    """Remove a build lock older than `max_age` seconds; True if one was removed.

    Why: torch's extension loader takes a lock file for the build and waits for it forever; a
    build killed midway (Ctrl-C, a CI timeout, the OOM killer) leaves the lock behind, and every
    later process would hang at its first decode step. A real build of this one file takes far
    less than `max_age`, even on a loaded machine.
    """
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= max_age:
        return False
    log.warning("removing a stale build lock %s (%.0f s old: a build that was killed)", lock, age)
    lock.unlink(missing_ok=True)
    return True


def available() -> bool:
    """True when the kernels are built and usable on this CPU."""
    return load() is not None


def gemv_bf16(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [M, K] (any float dtype) @ weight.T for a contiguous bf16 weight [N, K]; float32 accumulation."""
    return load().gemv_bf16(x, weight, out_dtype)


def gemv_f32(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] (any float dtype) @ weight.T for a contiguous float32 weight [N, K]."""
    return load().gemv_f32(x, weight, out_dtype)


def gemv_int8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] @ (q * scales[:, None]).T for an int8 weight [N, K] with one scale per row."""
    return load().gemv_int8(x, q, scales, out_dtype)


def gemv_int4(
    x: torch.Tensor, packed: "Int4Packed", out_dtype: torch.dtype = torch.bfloat16, int8_activations: bool = False
) -> torch.Tensor:
    """x [M, K] @ dequant(packed).T; with int8_activations, x is quantized per 32 features first."""
    fn = load().gemv_int4_a8 if int8_activations else load().gemv_int4
    return fn(x, packed.q, packed.scales, packed.zeros, packed.group, out_dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: "AttentionPlan",
    scale: float,
) -> torch.Tensor:
    """q [T, H, D] against one layer's paged cache [Hkv, slots, D] (K/V of q's tokens already written)."""
    return load().paged_attention(
        q.contiguous(),
        k_cache,
        v_cache,
        plan.block_tables,
        plan.context_lens,
        plan.query_starts,
        plan.query_lens,
        plan.block_size,
        scale,
        plan.window or 0,
    )


@dataclass(frozen=True)
class AttentionPlan:
    """Per-forward inputs of `paged_attention`, built once and shared by every layer."""

    block_tables: torch.Tensor  # [B, max_blocks] int64
    context_lens: torch.Tensor  # [B] int64
    query_starts: torch.Tensor  # [B] int64: first row of each sequence's queries
    query_lens: torch.Tensor  # [B] int64
    block_size: int
    window: int | None


def rope_write_kv(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE on qk rows [T, (H + Hkv) * D] and the keys and v rows [T, Hkv * D] written at `slots` of
    one layer's cache [Hkv, slots, D]; returns (q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]).

    The same roundings as `serve.layers.apply_rope` plus `KVCache.write`, in one call.
    """
    q, k, v_rows = load().rope_write_kv(qk, v, cos, sin, slots, k_cache, v_cache, num_heads)
    return q, k, v_rows


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of bf16 rows (float32 statistics, two bf16 roundings) in one call."""
    return load().rms_norm_bf16(x, weight, eps)


class Int4Packed:
    """A [N, K] int4 weight in the kernels' layout (see the C++ header), from kernel-order parts.

    q holds values 0..15 as int [K, N]; scales and zeros are [K/group, N] in torch's convention
    w = (q - 8) * scale + zero, rewritten here as w = q * scale + (zero - 8 * scale).
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> None:
        k, n = q.shape
        if not self.fits(k, group):
            raise ValueError(
                f"int4 layout needs a power-of-two group size ({group}) of at least {BLOCK} dividing in_features ({k})"
            )
        blocks = q.T.to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)
        self.q = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
        self.scales = scales.float().T.contiguous()
        self.zeros = (zeros.float() - 8 * scales.float()).T.contiguous()
        self.group = group

    @staticmethod
    def fits(in_features: int, group: int) -> bool:
        """Whether a weight with this shape and kernel group can use the layout."""
        return in_features % group == 0 and group % BLOCK == 0 and group & (group - 1) == 0


def main() -> int:
    """`python -m serve.cpu_kernels`: build (or find) the kernels and say which path serve uses."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print("serve CPU kernels:", "built, in use" if available() else "not available; torch's kernels are used")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
