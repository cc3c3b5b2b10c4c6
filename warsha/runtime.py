"""The process's allocator and thread policy, set once at start and recorded in every manifest.

Allocator. CPU training frees and re-maps hundreds of MB of activations every step; with glibc's
defaults each of those blocks is ``mmap``ed, returned to the kernel on free, and faulted and
zeroed again on the next step, so a third of the CPU time went to the kernel. ``glibc-tuned``
(the default) keeps blocks below 1 GiB on the heap and the heap's freed top mapped
(``mallopt`` through ctypes, before the first tensor), and exports the same values as
``MALLOC_*_`` variables so child processes (torchrun / deepspeed workers) start tuned.
``system`` leaves the C library alone. Retention stays bounded: a block of 1 GiB or more is
still ``mmap``ed and returned on free, the heap's top is trimmed once more than 1 GiB is free
there, and ``malloc_trim`` (context_ext's peak-memory accounting) still hands freed pages back.

Threads: one rule. ``OMP_NUM_THREADS`` when set (a launcher or the operator decided for this
machine), else the recipe's ``threads:``, else the physical cores this process may run on
(hyper-threads share one core's vector units, which dense float32 kernels already fill).
The count is not exported: each process resolves its own, and launchers of several processes
per machine (torchrun) set ``OMP_NUM_THREADS`` for their workers.

Precedence for the allocator likewise: ``WARSHA_ALLOCATOR`` when set, else the recipe's
``allocator:``, else ``glibc-tuned``.

Why a twin of ``serve/runtime.py`` instead of one shared module: ``serve`` deploys alone and
imports nothing of ``warsha``, and ``warsha`` imports ``serve`` only to validate a served
artifact; a third top-level package for twenty lines would be a new dependency edge for both.
The two are short and tested against the same glibc behaviour.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ALLOCATORS = ("glibc-tuned", "system")
# glibc <malloc.h>: the mallopt parameter numbers.
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
# The tuned values: blocks below 1 GiB stay on the heap; trim the top beyond 1 GiB free; grow
# the heap in 256 MiB steps (untouched pages cost no memory).
TUNED = {"mmap_threshold": 1 << 30, "trim_threshold": 1 << 30, "top_pad": 256 << 20}
_ENV_NAMES = {
    "mmap_threshold": "MALLOC_MMAP_THRESHOLD_",
    "trim_threshold": "MALLOC_TRIM_THRESHOLD_",
    "top_pad": "MALLOC_TOP_PAD_",
}
_PARAMS = {"mmap_threshold": M_MMAP_THRESHOLD, "trim_threshold": M_TRIM_THRESHOLD, "top_pad": M_TOP_PAD}

_active: dict[str, Any] = {}


class RuntimeConfigError(ValueError):
    """A bad ``WARSHA_ALLOCATOR`` or ``OMP_NUM_THREADS`` value (named in the message)."""


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyper-thread siblings counted once)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def resolve_threads(recipe_threads: int | None = None) -> tuple[int, str]:
    """The thread count and where it came from (``OMP_NUM_THREADS``, ``recipe`` or ``physical cores``)."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise RuntimeConfigError(f"OMP_NUM_THREADS={env!r}: must be a positive integer; unset it or fix it")
        return int(env), "OMP_NUM_THREADS"
    if recipe_threads is not None:
        return recipe_threads, "recipe"
    return physical_cores(), "physical cores"


def resolve_allocator(recipe_allocator: str | None = None) -> tuple[str, str]:
    """The allocator policy and where it came from (``WARSHA_ALLOCATOR``, ``recipe`` or ``default``)."""
    env = os.environ.get("WARSHA_ALLOCATOR", "").strip()
    if env:
        if env not in ALLOCATORS:
            raise RuntimeConfigError(f"WARSHA_ALLOCATOR={env!r}: must be one of {', '.join(ALLOCATORS)}")
        return env, "WARSHA_ALLOCATOR"
    if recipe_allocator is not None:
        return recipe_allocator, "recipe"
    return "glibc-tuned", "default"


def _libc() -> Any:
    """glibc's handle with ``mallopt``, or None (musl, macOS: those allocators are left alone)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return libc


def tune_glibc() -> bool:
    """Apply the tuned ``mallopt`` values here and export them to children; False without glibc."""
    libc = _libc()
    if libc is None:
        return False
    for key, value in TUNED.items():
        os.environ.setdefault(_ENV_NAMES[key], str(value))
        if libc.mallopt(_PARAMS[key], value) != 1:
            log.warning("mallopt(%s, %d) refused; the allocator keeps its default there", key, value)
    return True


def apply(allocator: str | None = None, threads: int | None = None) -> dict[str, Any]:
    """Resolve and apply the policy; returns what is active (as recorded in manifests).

    The allocator is set once per process: glibc cannot go back to its dynamic mmap threshold,
    so a later call asking for another policy is logged and the first one stays (and is what
    the manifest records). Threads can change at any time and follow the latest call.
    """
    name, source = resolve_allocator(allocator)
    if "allocator" not in _active:
        effective = name if name == "system" or tune_glibc() else "system"
        _active.update(allocator=effective, allocator_source=source if effective == name else "no glibc")
    elif _active["allocator"] != name:
        log.warning("allocator %s requested (%s) but %s is already active in this process", name, source,
                    _active["allocator"])  # fmt: skip
    count, tsource = resolve_threads(threads)
    _set_torch_threads(count)
    _active.update(threads=count, threads_source=tsource)
    return describe()


def _set_torch_threads(count: int) -> None:
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        import torch
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


def describe() -> dict[str, Any]:
    """The active policy for a manifest's ``runtime`` (empty if :func:`apply` never ran)."""
    out = dict(_active)
    if out.get("allocator") == "glibc-tuned":
        out["malloc"] = dict(TUNED)
    return out
