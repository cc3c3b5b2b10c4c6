"""The process's C allocator and thread count, set once at start (before the first tensor).

Why: a CPU training or prefill step frees and re-allocates hundreds of MB of activations. glibc
``mmap``s every block above its threshold and unmaps it on free, so each step pays page faults
and zeroing again, and a large share of the CPU time goes to the kernel (docs/stack.md).
Three policies (``WARSHA_ALLOCATOR``):

- ``tcmalloc`` (the default where ``libtcmalloc_minimal.so.4`` is installed, Debian/Ubuntu
  package ``libtcmalloc-minimal4``): keeps freed spans in its page heap and reuses them. It must
  be loaded before the C library's malloc is first used, so an entry point that asks for it
  re-executes itself once with ``LD_PRELOAD`` (``apply(reexec=True)``); children inherit it.
- ``glibc-tuned`` (the fallback): ``mallopt`` keeps blocks below 1 GiB on the heap and the
  heap's freed top mapped, and exports the same values as ``MALLOC_*_`` for children. Fewer
  faults than glibc's defaults, but freed blocks fragment the heap and are not always reused.
- ``system``: the C library as it is.

``benchmarks/train_bench.py --compare-allocators`` measures the three side by side.

Threads: ``OMP_NUM_THREADS`` when set, else the caller's explicit count, else the physical cores
this process may run on (hyper-threads share one core's vector units, which dense float32
kernels already fill).

This module is the lower layer: ``serve`` deploys alone and imports nothing of ``warsha``;
``warsha.runtime`` adds the recipe's fields and the manifest record on top of it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import sysconfig
from pathlib import Path
from typing import Any, NoReturn

log = logging.getLogger(__name__)

ALLOCATORS = ("tcmalloc", "glibc-tuned", "system")
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc <malloc.h>
# The tuned values: blocks below 1 GiB stay on the heap; trim the top beyond 1 GiB free; grow
# the heap in 256 MiB steps (untouched pages cost no memory).
TUNED = {"mmap_threshold": 1 << 30, "trim_threshold": 1 << 30, "top_pad": 256 << 20}
_MALLOPT = {
    "mmap_threshold": (M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_"),
    "trim_threshold": (M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_"),
    "top_pad": (M_TOP_PAD, "MALLOC_TOP_PAD_"),
}
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
TCMALLOC_ENV = "WARSHA_TCMALLOC"  # an explicit library path, for a non-standard install
REEXEC_MARK = "WARSHA_ALLOCATOR_REEXEC"  # set on the re-executed process: never re-execute twice
# tcmalloc prints a stack-less line to stderr for every allocation above 1 GiB by default
QUIET_TCMALLOC = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}


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


def _library_dirs() -> list[Path]:
    """Where the dynamic loader's packages put shared libraries on Linux distributions."""
    arch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    roots = ("/usr/lib", "/lib", "/usr/local/lib")
    return [Path(r) / arch for r in roots] + [Path(r) for r in (*roots, "/usr/lib64", "/lib64")]


def find_tcmalloc() -> str | None:
    """The tcmalloc shared library to preload: ``WARSHA_TCMALLOC`` if set, else a system install."""
    explicit = os.environ.get(TCMALLOC_ENV, "").strip()
    if explicit:
        return explicit if Path(explicit).is_file() else None
    for folder in _library_dirs():
        for name in TCMALLOC_NAMES:
            if (folder / name).is_file():
                return str(folder / name)
    return None


def tcmalloc_loaded() -> str | None:
    """The tcmalloc library mapped into this process, if any (read from ``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libtcmalloc" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return None


def default_allocator() -> str:
    """tcmalloc where it is installed or already loaded, else glibc-tuned."""
    return "tcmalloc" if tcmalloc_loaded() or find_tcmalloc() else "glibc-tuned"


def check_allocator(name: str, where: str) -> str:
    """``name`` if it is a policy this host can apply; a ValueError naming ``where`` otherwise."""
    if name not in ALLOCATORS:
        raise ValueError(f"{where}={name!r}: must be one of {', '.join(ALLOCATORS)}")
    if name == "tcmalloc" and not (tcmalloc_loaded() or find_tcmalloc()):
        raise ValueError(
            f"{where}=tcmalloc but no {' or '.join(TCMALLOC_NAMES)} was found: install it "
            f"(Debian/Ubuntu: apt-get install libtcmalloc-minimal4), set {TCMALLOC_ENV} to its path, "
            "or choose glibc-tuned"
        )
    return name


def reexec_with_tcmalloc(library: str) -> NoReturn:
    """Replace this process with the same command line, ``library`` preloaded (children inherit it)."""
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    env[REEXEC_MARK] = "1"
    for key, value in QUIET_TCMALLOC.items():
        env.setdefault(key, value)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def tune_glibc() -> bool:
    """Apply the tuned ``mallopt`` values here and export them to children; False without glibc."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    for key, value in TUNED.items():
        param, env = _MALLOPT[key]
        os.environ.setdefault(env, str(value))
        if mallopt(param, value) != 1:
            log.warning("mallopt(%s, %d) refused; the allocator keeps its default there", key, value)
    return True


def activate(name: str, reexec: bool) -> tuple[str, str | None]:
    """Put policy ``name`` in effect; returns the policy actually in effect and why it differs.

    A process that already has tcmalloc mapped (inherited ``LD_PRELOAD``) runs on it whatever
    was asked. Asked for tcmalloc without it: re-execute when ``reexec`` (entry points only,
    never a library call) and not already re-executed, else fall back to glibc-tuned.
    """
    loaded = tcmalloc_loaded()
    if loaded:
        return "tcmalloc", None if name == "tcmalloc" else "tcmalloc preloaded by the environment"
    if name == "tcmalloc":
        library = find_tcmalloc()
        if library and reexec and not os.environ.get(REEXEC_MARK):
            reexec_with_tcmalloc(library)
        name, why = "glibc-tuned", "tcmalloc not preloaded in this process"
    else:
        why = None
    if name == "glibc-tuned" and not tune_glibc():
        return "system", "no glibc"
    return name, why


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


def tune_allocator(reexec: bool = False) -> str:
    """Apply ``WARSHA_ALLOCATOR`` (default: tcmalloc if installed, else glibc-tuned); the policy in effect."""
    requested = os.environ.get("WARSHA_ALLOCATOR", "").strip()
    name = check_allocator(requested, "WARSHA_ALLOCATOR") if requested else default_allocator()
    return activate(name, reexec)[0]


def apply(threads: int | None = None, reexec: bool = False) -> dict[str, Any]:
    """Set the allocator and torch's thread count; returns both (the server logs them).

    ``reexec=True`` (the server's entry point) lets the process restart itself once to preload
    tcmalloc; the command line and environment are kept.
    """
    allocator = tune_allocator(reexec)
    count = thread_count(threads)
    import torch

    torch.set_num_threads(count)
    return {"allocator": allocator, "threads": count}
