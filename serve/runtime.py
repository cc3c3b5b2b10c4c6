"""The server process's allocator and thread policy, set once at start (before the weights load).

The same policy as Warsha's training processes: ``WARSHA_ALLOCATOR=glibc-tuned`` (the default)
keeps heap blocks below 1 GiB mapped (``mallopt`` through ctypes), so each decode step's
activations and the prefill buffers are reused instead of being mapped, faulted and zeroed
again; ``system`` leaves the C library alone. Threads: ``--threads`` when given, else
``OMP_NUM_THREADS``, else the physical cores this process may run on.

Why a twin of ``warsha/runtime.py`` instead of one shared module: ``serve`` deploys alone and
may import nothing of ``warsha`` (tests/test_layout.py), and ``warsha`` imports ``serve`` only to
validate a served artifact; the twenty lines of ctypes are cheaper than a new package that
both would depend on.
"""

from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path
from typing import Any

ALLOCATORS = ("glibc-tuned", "system")
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc <malloc.h>
TUNED = ((M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", 1 << 30), (M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", 1 << 30),
         (M_TOP_PAD, "MALLOC_TOP_PAD_", 256 << 20))  # fmt: skip


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


def tune_allocator() -> str:
    """Apply ``WARSHA_ALLOCATOR`` (default glibc-tuned); returns the policy in effect."""
    name = os.environ.get("WARSHA_ALLOCATOR", "").strip() or "glibc-tuned"
    if name not in ALLOCATORS:
        raise ValueError(f"WARSHA_ALLOCATOR={name!r}: must be one of {', '.join(ALLOCATORS)}")
    if name == "system" or platform.libc_ver()[0] != "glibc":
        return "system"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "system"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    for param, env, value in TUNED:
        os.environ.setdefault(env, str(value))
        mallopt(param, value)
    return name


def thread_count(flag: int | None) -> int:
    """``--threads``, else ``OMP_NUM_THREADS``, else physical cores."""
    if flag is not None:
        if flag < 1:
            raise ValueError(f"--threads {flag}: must be >= 1")
        return flag
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"OMP_NUM_THREADS={env!r}: must be a positive integer; unset it or fix it")
        return int(env)
    return physical_cores()


def apply(threads: int | None = None) -> dict[str, Any]:
    """Set the allocator and torch's thread count; returns both (the server logs them)."""
    allocator = tune_allocator()
    count = thread_count(threads)
    import torch

    torch.set_num_threads(count)
    return {"allocator": allocator, "threads": count}
