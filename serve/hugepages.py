"""Weights and the KV cache on transparent huge pages (2 MiB) where the OS gives them.

Why: a CPU decode step streams every weight once (536 MB for Gemma 3 270M in bf16), and on 4 KiB
pages that is one TLB miss and page walk per 4 KiB read. Measured on a 2-core Zen 4 VM (THP
`madvise`, the default of most distributions), the same engine and model: 20.3-26.9 ms a
bf16 decode step on torch's allocations against 14.6-15.5 ms with the weights on huge pages
(`THP_MEM_ALLOC_ENABLE=1`, torch's own switch, which only works when set before torch allocates
anything). llama.cpp gets the same without asking when it maps its GGUF file and the page cache
holds the file in large folios.

How: weights are copied once, at load, into anonymous private mappings advised `MADV_HUGEPAGE`
before their first touch, so the page faults of the copy take 2 MiB pages. Small weights share
64 MiB chunks (a 1.3 MB projection alone could never fill a huge page); each chunk lives as long
as any weight in it. The KV cache gets its own mapping. Where THP is `never`, the platform is not
Linux, or `WARSHA_HUGE_PAGES=0`, every function here hands back ordinary torch memory.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 64 << 20  # one mapping shared by the weights smaller than this
MIN_BYTES = 1 << 16  # smaller tensors stay where they are: a few pages' worth of TLB entries
ALIGN = 64  # every placed tensor starts on a cache line
ENV = "WARSHA_HUGE_PAGES"  # "0" turns the placement off (A/B measurements)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_BASES: set[int] = set()  # storage addresses of the mappings made


def thp_mode() -> str:
    """The kernel's THP setting ("always", "madvise", "never"), or "absent" off Linux."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return "absent"
    chosen = [w for w in text.split() if w.startswith("[")]
    return chosen[0].strip("[]") if chosen else "absent"


def enabled() -> bool:
    """Whether placement is on: THP `always` or `madvise`, `MADV_HUGEPAGE` known, not switched off."""
    on = os.environ.get(ENV, "1") != "0"
    return on and hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def _mapping(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 tensor of `nbytes` (rounded up to 2 MiB) starting on a 2 MiB boundary,
    advised for huge pages before anything touches it."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mm = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # the tensor's storage keeps `mm` alive
    _BASES.add(whole.untyped_storage().data_ptr())
    start = (-whole.data_ptr()) % HUGE_PAGE
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, start, size)
    except OSError:  # a kernel built without THP: ordinary pages, same bytes
        pass
    return whole[start : start + size]


class _Arena:
    """Bump allocation of cache-line-aligned slices from huge-page chunks."""

    def __init__(self) -> None:
        self.chunk: torch.Tensor | None = None
        self.used = 0
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A fresh uint8 slice of `nbytes` (zeroed, never handed out before)."""
        with self.lock:
            if self.chunk is None or self.used + nbytes > self.chunk.numel():
                self.chunk, self.used = _mapping(max(CHUNK_BYTES, nbytes)), 0
            out = self.chunk[self.used : self.used + nbytes]
            self.used += -(-nbytes // ALIGN) * ALIGN
            return out


_ARENA = _Arena()


def place(t: torch.Tensor) -> torch.Tensor:
    """`t` copied onto huge pages (same values, dtype and shape, contiguous), or `t` itself where
    placement is off, `t` is not on the CPU, is small, or was placed already."""
    if t.device.type != "cpu" or t.nbytes < MIN_BYTES or not enabled() or placed(t):
        return t
    t = t.contiguous()
    out = _ARENA.take(t.nbytes).view(t.dtype).view(t.shape)
    return out.copy_(t)


def placed(t: torch.Tensor) -> bool:
    """Whether `t` lives in one of this module's mappings (a `place` or `zeros` result, or a view).

    Compares storage addresses with those of the mappings made so far: an address freed and
    reused by torch would read as placed, which only skips a copy (the tensor stays correct)."""
    return t.device.type == "cpu" and t.untyped_storage().data_ptr() in _BASES


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in its own huge-page mapping (the KV cache), or `torch.zeros` where off.

    Every page is touched here, once, as `torch.zeros` touches its memory: a mapping left to
    fault page by page while serving moves each first write's page fault (and the kernel's
    zeroing of 2 MiB) into a request's step. The block manager hands out never-used blocks
    first (they hold no cached prefix), so a fresh engine walks the whole cache: on a 2-core
    Zen 4 VM, Gemma 3 270M's 64-request mixed workload spent 2.3-2.8 ms of a 113-116 ms step
    in those faults (the `rope + kv write` timer of `benchmarks.decode_profile`: 3.25 -> 0.99
    ms); the touch costs 0.05-1.1 s per GiB at start, depending on how fragmented the host's
    free memory is."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for n in shape:
        numel *= n
    if not enabled() or numel * itemsize < HUGE_PAGE:  # below one huge page: nothing to gain
        return torch.zeros(shape, dtype=dtype)
    out = _mapping(numel * itemsize)[: numel * itemsize]
    out.zero_()  # writes fault every page in now, on torch's threads (reads would map the zero page)
    return out.view(dtype).view(shape)


def huge_bytes() -> int:
    """Bytes of this process's anonymous memory on huge pages now (/proc/self/smaps_rollup), 0 if unknown."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
