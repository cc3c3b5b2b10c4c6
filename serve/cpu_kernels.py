"""Serve's own CPU kernels (`csrc/`): build, load, ISA choice, the int4 layout and paged attention.

Why: a decode step reads every weight once for a handful of activation rows. On an AVX2-only
CPU torch's bf16 matrix-vector product and its int4 kernel are bound by their own arithmetic,
not by memory (see the C++ file's header for the measurements); these kernels widen each weight
block once and reuse it for up to 8 rows. They are compiled on first use with torch's C++
extension builder (g++ and ninja; about a minute, cached under TORCH_EXTENSIONS_DIR) and used
for up to `MAX_ROWS` rows: decode steps and speculative verification. `csrc/attention.cpp`
attends short query chunks (the same steps) straight from the paged cache; `csrc/rope_kv.cpp`
rotates the new queries and keys and writes K/V into the cache in one call per layer. Without a compiler, on a
CPU without AVX2+FMA, or with WARSHA_SERVE_CPU_KERNELS=0, the engine keeps torch's kernels and
says so once in the log.

ISA: the matrix products exist in four variants in the one build (`csrc/gemv.cpp`): avx2,
avx512 (512-bit vectors), avx512_vnni (the int4 x int8 path's multiplier product fused into
vpdpwssd) and avx512_bf16 (bf16 weights times bf16 activations with vdpbf16ps); a fifth, amx,
runs the avx512_bf16 kernels and adds AMX tile GEMMs (`csrc/amx.cpp`, `amx_linear`) for bf16
batches larger than the one-row kernel takes (mixed steps, prefill). `load` picks the
most capable one the CPU's flags allow (`/proc/cpuinfo`), or the one `WARSHA_CPU_ISA` names
(e.g. `WARSHA_CPU_ISA=avx2` to compare against the AVX2 kernels on an AVX-512 host); `isa()`
reports it for `/metrics` and the manifest's `runtime.isa`. Attention, RoPE and RMSNorm have one
(AVX2) variant.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from serve import hugepages

log = logging.getLogger("serve.cpu_kernels")

CSRC = Path(__file__).resolve().parent / "csrc"
CPP_FILES = (
    "gemv.cpp",
    "amx.cpp",
    "gemm_bf16.cpp",
    "attention.cpp",
    "rope_kv.cpp",
    "argmax.cpp",
    "screen.cpp",
    "screen_gemm.cpp",
    "norm.cpp",
    "act.cpp",
    "bindings.cpp",
)
SOURCES = tuple(CSRC / name for name in CPP_FILES)
HEADERS = tuple(
    CSRC / name
    for name in ("amx_tiles.h", "bf16.h", "norm.h", "rows.h", "vmath.h", "gemv_impl.h", "attention_avx512.h")
)
MAX_ROWS = 16  # beyond this, oneDNN/MKL GEMMs and torch's int4 kernel win (they block over rows)
BLOCK = 32  # input features per int4 block of the packed layout
SCREEN_TILE = 32  # logit columns per tile of the batch head screen (csrc/screen_gemm.cpp, kGroupCols)
SCREEN_AMX_K = 64  # uint8 channels per AMX tile row: the screen's main channels pad to this on AMX
ENV_SWITCH = "WARSHA_SERVE_CPU_KERNELS"
# -fopenmp: at::parallel_for is an OpenMP pragma in torch's headers; without the flag the kernels
# silently run on one thread. The runtime loaded is torch's own libgomp (same soname).
# -ffp-contract=off: products and sums round as torch's separate ops do (RoPE must match torch
# bit for bit); the kernels' FMAs are explicit intrinsics, which the flag leaves alone.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"]
LDFLAGS = ["-fopenmp"]
STALE_LOCK_SECONDS = 600.0
ISA_ENV = "WARSHA_CPU_ISA"
# Each variant and the /proc/cpuinfo flags it needs, least capable first (a CPU with avx512_bf16
# has VNNI too: Cooper Lake, Sapphire Rapids, Zen 4). amx: the avx512_bf16 kernels plus AMX tile
# GEMMs for bf16 batches past the one-row kernel's reach (csrc/amx.cpp); it also needs the OS to
# grant the tile state (Linux 5.16+), asked for at load: where refused, avx512_bf16 runs instead.
_AVX512 = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq")
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": _AVX512,
    "avx512_vnni": (*_AVX512, "avx512_vnni"),
    "avx512_bf16": (*_AVX512, "avx512_vnni", "avx512_bf16"),
    "amx": (*_AVX512, "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"),
}
ISAS = tuple(ISA_FLAGS)


def _cpu_has_avx2() -> bool:
    """AVX2 and FMA present (torch's own dispatch level says AVX2 or better)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability in ("AVX2", "AVX512", "AVX512_BF16", "AMX") or capability.startswith("AVX512")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo; from torch's dispatch level where it is absent."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith(("AVX512", "AMX")):
        return frozenset(ISA_FLAGS["avx512"])
    return frozenset(ISA_FLAGS["avx2"]) if capability == "AVX2" else frozenset()


def supported_isas(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The kernel variants this CPU can run, least capable first (empty without AVX2+FMA)."""
    have = cpu_flags() if flags is None else flags
    return tuple(name for name, needs in ISA_FLAGS.items() if set(needs) <= have)


def select_isa(flags: frozenset[str] | None = None, env: str | None = None) -> str | None:
    """`WARSHA_CPU_ISA` when set (it must be a variant this CPU runs), else the most capable one.

    None where the CPU runs none (no AVX2). A bad value is a ValueError naming the variable,
    the CPU's variants and the fix, raised before anything is built.
    """
    supported = supported_isas(flags)
    wanted = (os.environ.get(ISA_ENV, "") if env is None else env).strip().lower()
    if not wanted:
        return supported[-1] if supported else None
    if wanted not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}={wanted!r}: must be one of {', '.join(ISAS)}; unset it to pick the CPU's best")
    if wanted not in supported:
        missing = sorted(set(ISA_FLAGS[wanted]) - (cpu_flags() if flags is None else flags))
        raise ValueError(
            f"{ISA_ENV}={wanted}: this CPU lacks {', '.join(missing)}; it runs {', '.join(supported) or 'none'}"
        )
    return wanted


def isa() -> str:
    """The variant serve's matrix products run ("none" where the kernels are unavailable)."""
    lib = load()
    return lib.current_isa() if lib is not None else "none"


def has_bf16_dot() -> bool:
    """True when the running variant multiplies bf16 by bf16 natively (vdpbf16ps: avx512_bf16, amx)."""
    return isa() in ("avx512_bf16", "amx")


def has_amx() -> bool:
    """True when the running variant has AMX tile GEMMs for bf16 batches (`amx_linear`)."""
    return isa() == "amx"


def amx_fits(weight: torch.Tensor) -> bool:
    """Whether `amx_linear` takes this weight: a bf16 CPU matrix of 16k outputs and 32k inputs, AMX running."""
    n, k = weight.shape
    return has_amx() and weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and n % 16 == 0 and k % 32 == 0


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """The tile-ordered copy of a bf16 weight [N, K] that `amx_linear` reads (see csrc/amx.cpp)."""
    return load().amx_pack_bf16(weight)


def amx_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] bf16 @ W.T (+ bias) on AMX tiles: bf16 rounded once, or into a float32 `out` through bf16."""
    if out is None:
        return load().amx_linear_bf16(x, packed, bias)
    load().amx_linear_bf16_out(x, packed, bias, out, True)
    return out


@contextlib.contextmanager
def _switched(current: str, choose: str, value: str) -> Iterator[None]:
    """Inside the block the library's setting runs `value` (lib.<choose>); lib.<current> is restored after."""
    lib = load()
    if lib is None:
        raise RuntimeError("serve's CPU kernels are not available here")
    before = getattr(lib, current)()
    getattr(lib, choose)(value)
    try:
        yield
    finally:
        getattr(lib, choose)(before)


def use_isa(name: str) -> contextlib.AbstractContextManager[None]:
    """Run the kernels' `name` variant inside the block (tests and benchmarks compare variants)."""
    return _switched("current_isa", "set_isa", name)


def row_order() -> str:
    """How one-row products walk the weights: "stream" (row after row; AMD and other non-Intel
    CPUs) or "interleave" (groups of rows block by block; Intel); "none" without the kernels.
    Both give the same bits (csrc/gemv.cpp, g_stream_rows)."""
    lib = load()
    return lib.row_order() if lib is not None else "none"


def use_row_order(order: str) -> contextlib.AbstractContextManager[None]:
    """One-row products walk the weights in `order` ("stream" or "interleave") inside the block."""
    return _switched("row_order", "set_row_order", order)


@functools.lru_cache(maxsize=1)
def load() -> ModuleType | None:
    """The compiled extension, or None (and one log line naming why) where it cannot run."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        log.info("%s=0: using torch's CPU kernels for small batches", ENV_SWITCH)
        return None
    chosen = select_isa()
    if chosen is None or not _cpu_has_avx2():
        log.warning(
            "CPU lacks AVX2/FMA (torch reports %s): using torch's CPU kernels", torch.backends.cpu.get_cpu_capability()
        )
        return None
    lib = _build()
    if lib is not None:
        if chosen == "amx" and not lib.amx_enable():
            log.warning("the OS refused the AMX tile state (Linux 5.16+ grants it): running avx512_bf16")
            chosen = "avx512_bf16"
        lib.set_isa(chosen)
        how = (
            f"{ISA_ENV}={chosen}"
            if os.environ.get(ISA_ENV, "").strip()
            else f"this CPU's best of {', '.join(supported_isas())}"
        )
        log.info("serve's CPU kernels: %s variant (%s)", chosen, how)
    return lib


def extension_name(csrc: Path = CSRC) -> str:
    """The library's name: a hash of the sources under `csrc`, the flags, and `csrc` itself.

    Checkouts of different versions never rebuild each other's library (nor replace it under a
    running process), and neither do two checkouts of one version: torch's build.ninja names the
    source paths, so with one name each would rebuild every object the other built, a minute or
    more each time (and a test waiting on the other's build lock timed out).
    """
    text = b"".join((csrc / src.name).read_bytes() for src in SOURCES + HEADERS)
    digest = hashlib.sha256(text + " ".join([*CFLAGS, *LDFLAGS, str(csrc)]).encode()).hexdigest()[:12]
    return f"warsha_serve_gemv_avx2_{digest}"


def _build() -> ModuleType | None:
    """Build (or find) the extension; None, after one log line naming why, where it fails."""
    try:
        from torch.utils import cpp_extension

        name = extension_name()
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        with build_lock(build_dir):
            return cpp_extension.load(
                name=name,
                sources=[str(src) for src in SOURCES],
                extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS,
                verbose=False,
            )
    except Exception as err:  # noqa: BLE001 - any build failure means: fall back, loudly
        log.warning(
            "could not build serve's CPU kernels (%s: %s); using torch's CPU kernels, which are slower here",
            type(err).__name__,
            str(err).splitlines()[0] if str(err) else "",
        )
        return None


OWNER_FILE = "warsha.owner"  # beside torch's `lock`: "<host> <pid>" of the process building there


@contextlib.contextmanager
def build_lock(build_dir: Path, max_age: float = STALE_LOCK_SECONDS, poll: float = 0.5) -> Iterator[None]:
    """Hold the right to build in `build_dir` for the block; waits, loudly, for a live builder.

    Why: torch's extension loader takes a lock file (`lock`) for the build and waits for it
    without a word; a build killed midway (Ctrl-C during the first `warsha serve`, a CI timeout,
    the OOM killer) left it behind and the next start hung silently for up to `max_age`. Here
    the builder first records itself in `warsha.owner` (host and pid, created exclusively). A
    later process that finds the owner gone (same host, no such pid) takes over at once,
    removing both files; one whose owner is alive says once whom it waits for and why. A
    `lock` without an owner record (a builder that did not record itself) is waited for, with
    the same one message, until it goes or grows older than `max_age`.
    """
    owner, lock = build_dir / OWNER_FILE, build_dir / "lock"
    announced = False
    while not _claim(owner):
        holder, alive = _owner_of(owner, max_age)
        if not alive:
            log.warning("taking over serve's kernel build in %s: its owner (%s) is gone", build_dir, holder)
            owner.unlink(missing_ok=True)
            lock.unlink(missing_ok=True)
            continue
        if not announced:
            log.warning(
                "waiting for %s, which is building serve's CPU kernels in %s (lock %s): a first build "
                "takes a minute or more; a lock whose owner dies is taken over at once",
                holder,
                build_dir,
                owner,
            )
            announced = True
        time.sleep(poll)
    try:
        while lock.exists() and not clear_stale_lock(build_dir, max_age):
            if not announced:
                log.warning(
                    "waiting for a build lock %s with no owner recorded (another build, or one that was killed): "
                    "taken over when it is %.0f s old",
                    lock,
                    max_age,
                )
                announced = True
            time.sleep(poll)
        yield
    finally:
        owner.unlink(missing_ok=True)


def _claim(owner: Path) -> bool:
    """Create `owner` with this host and pid, only if no one holds it; True on success."""
    try:
        fd = os.open(owner, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as out:
        out.write(f"{socket.gethostname()} {os.getpid()}\n")
    return True


def _owner_of(owner: Path, max_age: float) -> tuple[str, bool]:
    """(who holds `owner`, whether it may still be building).

    Gone: a pid of this host that no longer exists, a record older than `max_age` that cannot
    be checked (another host), or an empty record older than a few seconds (its writer died
    between creating and writing it). A record that vanished meanwhile counts as gone: retry.
    """
    try:
        text, age = owner.read_text().split(), time.time() - owner.stat().st_mtime
    except FileNotFoundError:
        return "a finished build", False
    if len(text) != 2 or not text[1].isdigit():
        return "an unfinished record", age < 5.0
    host, pid = text[0], int(text[1])
    who = f"pid {pid} on {host}"
    if host != socket.gethostname():
        return who, age <= max_age
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return who, False
    except PermissionError:  # another user's live process
        return who, True
    return who, True


def clear_stale_lock(build_dir: Path, max_age: float = STALE_LOCK_SECONDS) -> bool:
    """Remove torch's build lock when older than `max_age` seconds; True if one was removed.

    For a lock with no owner recorded (see `build_lock`): a real build takes far less than
    `max_age`, even on a loaded machine.
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


def gemv_bf16_out(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, round_bf16: bool = True) -> torch.Tensor:
    """`gemv_bf16` into a float32 `out` [M, N] the caller owns (the logits buffer), rounded
    through bf16 when `round_bf16`: the numbers of gemv_bf16 to bf16 then `.float()`, in one pass."""
    load().gemv_bf16_out(x, weight, out, round_bf16)
    return out


def gemv_f32(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] (any float dtype) @ weight.T for a contiguous float32 weight [N, K]."""
    return load().gemv_f32(x, weight, out_dtype)


def gemv_int8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] @ (q * scales[:, None]).T for an int8 weight [N, K] with one scale per row.

    On the 512-bit VNNI variants each row of x is first rounded to int16 with one scale
    (`int8_rounds_activations`, `round_rows_int16`; csrc/gemv.cpp says why)."""
    return load().gemv_int8(x, q, scales, out_dtype)


def int8_rounds_activations(in_features: int) -> bool:
    """Whether `gemv_int8` rounds its activation rows to int16 here for this many input features."""
    return bool(load().int8_rounds_activations(in_features))


def round_rows_int16(x: torch.Tensor) -> torch.Tensor:
    """float32 rows of x [M, K] rounded as `gemv_int8` rounds them: S * round(x / S), S = max|x| / 32767."""
    return load().round_rows_int16(x)


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
    qk_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE on qk rows [T, (H + Hkv) * D] and the keys and v rows [T, Hkv * D] written at `slots` of
    one layer's cache [Hkv, slots, D]; returns (q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]).

    The same roundings as `serve.layers.apply_rope` plus `KVCache.write`, in one call; with
    `qk_weight` (float32 [H + Hkv, D], Gemma's 1 + w; bf16 rows) each head is first normalised as
    `serve.layers.Norm` would (the same bits).
    """
    q, k, v_rows = load().rope_write_kv(qk, v, cos, sin, slots, k_cache, v_cache, num_heads, qk_weight, eps)
    return q, k, v_rows


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) of float32 CPU logits [rows, vocab] at memory speed (greedy sampling)."""
    return load().argmax_rows(logits)


def screen_candidates(
    approx: torch.Tensor,
    scale: torch.Tensor,
    scale_l1: torch.Tensor,
    a: torch.Tensor,
    c: torch.Tensor,
    step: float,
    slack: float = 1e-6,
) -> torch.Tensor:
    """Ascending int64 columns of approx [rows, V] whose upper bound approx + a*scale + c*scale_l1
    reaches its row's best lower bound less `step` of the larger best bound and less `slack`
    (serve/head_screen.py)."""
    return load().screen_candidates(approx, scale, scale_l1, a, c, step, slack)


def screen_pack(
    q: torch.Tensor, perm: torch.Tensor, main: torch.Tensor, tail_rows: torch.Tensor, rowsum: torch.Tensor
) -> None:
    """Fill the batch screen's layouts from a head's int8 copy q [V, K], channels in `perm`'s order
    (main, then tail): main int8 [Vp / 16, Km * 16] packed, tail_rows int16 [Vp, T] row-major and
    rowsum int32 [Vp] (csrc/screen_gemm.cpp; rows past V and channels past K - T zero)."""
    load().screen_pack(q, perm, main, tail_rows, rowsum)


def screen_quantize(x: torch.Tensor, main_features: int, tail: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 rows x [M, K] (last `tail` channels wide) as the batch screen reads them: uint8
    [M, main_features], int16 [M, tail] and float32 [M, 3] (t, t2, zero point; csrc/screen_gemm.cpp)."""
    u, w16, params = load().screen_quantize(x, main_features, tail)
    return u, w16, params


def screen_on_amx() -> bool:
    """True when the batch screen's main sums run on AMX tiles (TDPBUSD): the amx variant on a CPU
    with AMX-INT8. The packed head then pads its main channels to a multiple of `SCREEN_AMX_K`."""
    return has_amx() and "amx_int8" in cpu_flags()


def screen_gemm_u8(
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    scales: tuple[torch.Tensor, torch.Tensor],
    a: torch.Tensor,
    c: torch.Tensor,
    out: torch.Tensor,
    amx: bool | None = None,
    floor: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The batch screen's int8 logits into out [M, V] from `screen_quantize` rows, the packed head
    (main, tail, rowsum, and the tail as int8 quads for AMX or empty) and its (scale, scale_l1);
    returns each row's best (lower, upper) bound [M, 2] under b = a * scale + c * scale_l1, each
    row's largest upper bound per tile of `SCREEN_TILE` columns [M, ceil(V / SCREEN_TILE)], and
    with `floor` which 16-column blocks hold logits (AVX-512 VNNI; csrc/screen_gemm.cpp).
    `amx`: the sums on AMX tiles (the same integers); None takes them there where `screen_on_amx()`,
    the main channels are a multiple of `SCREEN_AMX_K` and the int8 tail is packed.
    `floor` (step, slack of `screen_pairs`): sparse stores, a block of 16 logits is stored only
    where an upper bound reaches the row's floor so far, the others keep whatever `out` held;
    uint8 [M, 2 * tiles]: 0 left, 1 stored, 2 stored after the pass (its row's floor fell below
    one it skipped blocks under). Hand it to `screen_pairs`, which then skips the blocks left."""
    if amx is None:
        amx = screen_on_amx() and rows[0].shape[1] % SCREEN_AMX_K == 0 and packed[3].numel() > 0
    tile_hi = torch.empty(out.shape[0], -(-out.shape[1] // SCREEN_TILE))
    written = torch.empty(out.shape[0] * 2 * tile_hi.shape[1] if floor else 0, dtype=torch.uint8)
    step, slack = floor or (0.0, 0.0)
    main, tail, rowsum, tail8 = packed
    bounds = load().screen_gemm_u8(
        *rows, main, tail, rowsum, *scales, a, c, out, tile_hi, tail8, amx, step, slack, written
    )
    return bounds, tile_hi, written.view(out.shape[0], -1) if floor else None


def screen_pairs(
    approx: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor],
    a: torch.Tensor,
    c: torch.Tensor,
    lohi: torch.Tensor,
    tile_hi: torch.Tensor,
    step: float,
    slack: float,
    cap: int,
    written: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of approx, the columns that can hold its argmax (the floor of `screen_candidates`
    from the best bounds lohi): (rows, cols) int64 in row-major order and per-row counts, -1 for a
    row with more than `cap` (AVX-512). Tiles whose `tile_hi` (`screen_gemm_u8`'s) stays below a
    row's floor are not read, nor blocks that `written` (sparse stores') says were left."""
    empty = torch.empty(0, dtype=torch.uint8)
    rows, cols, counts = load().screen_pairs(
        approx, *scales, a, c, lohi, tile_hi, step, slack, cap, empty if written is None else written
    )
    return rows, cols, counts


def gemv_f32_pairs(x: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """float32 [P]: x[rows[p]] . w[cols[p]] for float32 x and w, float32 sums in a fixed order (AVX-512)."""
    out = torch.empty(rows.numel())
    load().gemv_f32_pairs(x, w, rows, cols, out)
    return out


def gemv_bf16_pairs(x: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """float32 [P]: x[rows[p]] . w[cols[p]] for bf16 x and w, each as `gemv_bf16` gives it to a
    decode batch (rounded through bf16); avx512_bf16 and amx variants only."""
    out = torch.empty(rows.numel())
    load().gemv_bf16_pairs(x, w, rows, cols, out)
    return out


def add_rms_norm_bf16(
    x: torch.Tensor, y: torch.Tensor, w_y: torch.Tensor | None, w_x: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x + norm_y(y), norm_x(that sum)) for bf16 rows in one pass, rounded where torch's separate
    ops round (csrc/norm.cpp): w_y float32 (Gemma's 1 + w) or None (add y as is); w_x float32 (one
    rounding), bf16 (transformers' two) or None (no next norm: the second result is None)."""
    xo, h = load().add_rms_norm_bf16(x, y, w_y, w_x, eps)
    return xo, (h if w_x is not None else None)


def gemm_bf16_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [M, N]: x [M, K] @ weight.T (+ a float32 bias) for bf16 x and weight, float32 sums rounded
    once, the weight read in place and asked for ahead (csrc/gemm_bf16.cpp); avx512_bf16 and amx only."""
    return load().gemm_bf16_rows(x, weight, bias)


def gated_act_bf16(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act(gate) * up of bf16 rows [T, 2I] holding gate then up, [T, I] bf16, in one call
    (act: tanh GELU when `gelu`, else SiLU; torch's two roundings, see csrc/act.cpp)."""
    return load().gated_act_bf16(gate_up, gelu)


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of bf16 rows (float32 statistics, two bf16 roundings) in one call."""
    return load().rms_norm_bf16(x, weight, eps)


def rms_norm_bf16_scaled(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(rms_norm(x.float()) * weight).to(bf16) for bf16 rows and a float32 weight [..., hidden], in one call."""
    return load().rms_norm_bf16_scaled(x, weight, eps)


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
        # on huge pages where the OS gives them: decode rows stream these (serve.hugepages)
        self.q = hugepages.place((blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous())
        self.scales = hugepages.place(scales.float().T.contiguous())
        self.zeros = hugepages.place((zeros.float() - 8 * scales.float()).T.contiguous())
        self.group = group

    @staticmethod
    def fits(in_features: int, group: int) -> bool:
        """Whether a weight with this shape and kernel group can use the layout."""
        return in_features % group == 0 and group % BLOCK == 0 and group & (group - 1) == 0


def main() -> int:
    """`python -m serve.cpu_kernels`: build (or find) the kernels and say which path serve uses."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if available():
        print(
            f"serve CPU kernels: built, in use; ISA variant {isa()} (this CPU runs {', '.join(supported_isas())}); "
            f"one-row products {row_order()}; weights and KV cache on huge pages: "
            f"{'yes' if hugepages.enabled() else 'no'} (THP {hugepages.thp_mode()}, {hugepages.ENV}=0 turns it off)"
        )
    else:
        print("serve CPU kernels: not available; torch's kernels are used")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
