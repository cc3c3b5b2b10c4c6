"""The process's allocator and thread policy, set once at start and recorded in every manifest.

The mechanisms (tcmalloc preloaded by re-executing the entry point, glibc tuned through
``mallopt``, the physical-core count) live in ``serve.runtime``, the lower layer that the
server uses alone; its docstring says why each policy exists. This module adds the recipe's
fields and the manifest record.

Allocator precedence: ``WARSHA_ALLOCATOR`` when set, else the recipe's ``allocator:``, else
``tcmalloc`` where it is installed and ``glibc-tuned`` where it is not. Entry points (``warsha
run``, the benchmarks, the test session) call ``apply(reexec=True)``; a library caller never
has its process replaced, and gets glibc-tuned if tcmalloc was not preloaded.

Threads: one rule. ``OMP_NUM_THREADS`` when set (a launcher or the operator decided for this
machine), else the recipe's ``threads:``, else the physical cores this process may run on.
The count is not exported: each process resolves its own, and launchers of several processes
per machine (torchrun) set ``OMP_NUM_THREADS`` for their workers.
"""

from __future__ import annotations

import logging
import os
import resource
from typing import Any

from serve import runtime as base
from serve.runtime import ALLOCATORS, REEXEC_MARK, TUNED, physical_cores

log = logging.getLogger(__name__)

__all__ = [
    "ALLOCATORS",
    "REEXEC_MARK",
    "TUNED",
    "RuntimeConfigError",
    "apply",
    "cpu_seconds",
    "cpu_since",
    "describe",
    "physical_cores",
]

_active: dict[str, Any] = {}


class RuntimeConfigError(ValueError):
    """A bad ``WARSHA_ALLOCATOR`` or ``OMP_NUM_THREADS`` value (named in the message)."""


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
    name, source = (env, "WARSHA_ALLOCATOR") if env else (recipe_allocator, "recipe")
    if name is None:
        return base.default_allocator(), "default"
    try:
        return base.check_allocator(name, "WARSHA_ALLOCATOR" if env else "allocator"), source
    except ValueError as err:
        raise RuntimeConfigError(str(err)) from None


def apply(allocator: str | None = None, threads: int | None = None, reexec: bool = False) -> dict[str, Any]:
    """Resolve and apply the policy; returns what is active (as recorded in manifests).

    ``reexec=True`` (entry points only) lets the process restart itself once, same command line
    and environment, with tcmalloc preloaded. The allocator is set once per process: glibc
    cannot go back to its dynamic mmap threshold, nor a process unload tcmalloc, so a later
    call asking for another policy is logged and the first one stays (and is what the manifest
    records). Threads can change at any time and follow the latest call.
    """
    name, source = resolve_allocator(allocator)
    if "allocator" not in _active:
        effective, why = base.activate(name, reexec)
        _active.update(allocator=effective, allocator_source=why or source)
        if why:
            log.info("allocator %s requested (%s); %s in effect: %s", name, source, effective, why)
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
    if out:
        out["isa"] = _cpu_isa()
        out["huge_pages"] = _huge_pages()
        out["scoring"] = _scoring_dtype()
    if out.get("allocator") == "glibc-tuned":
        out["malloc"] = dict(TUNED)
    elif out.get("allocator") == "tcmalloc":
        out["library"] = base.tcmalloc_loaded()
    return out


def _scoring_dtype() -> str:
    """What float32 models are scored in here (``warsha.score_forward``): bfloat16 where the
    device is fast at it, else float32."""
    from warsha.precision import dtype_name

    return dtype_name(None, "auto")


def _cpu_isa() -> str:
    """The ISA variant serve's CPU kernels choose here (by the CPU's flags and ``WARSHA_CPU_ISA``),
    without building them; "none" without AVX2, "invalid WARSHA_CPU_ISA" for a value they refuse."""
    from serve import cpu_kernels

    try:
        return cpu_kernels.select_isa() or "none"
    except ValueError:
        return f"invalid {cpu_kernels.ISA_ENV}"


def _huge_pages() -> str:
    """Whether serve puts weights and the KV cache on huge pages here, with the kernel's THP setting
    ("on (THP madvise)", "off (THP never)"; `serve.hugepages`)."""
    from serve import hugepages

    return f"{'on' if hugepages.enabled() else 'off'} (THP {hugepages.thp_mode()})"


def cpu_seconds() -> tuple[float, float]:
    """(user, system) CPU seconds used so far by this process and the children it has waited for.

    The system share is the figure the allocator policy exists to keep small: page faults and
    zeroing of re-mapped memory are charged to the kernel, so a stage whose system time grows
    against its user time is paying for its allocations rather than its arithmetic.
    """
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + kids.ru_utime, own.ru_stime + kids.ru_stime


def cpu_since(start: tuple[float, float]) -> dict[str, float]:
    """CPU time since ``start`` (from :func:`cpu_seconds`) for a manifest: user, sys, sys/user."""
    user, sys_ = (now - then for now, then in zip(cpu_seconds(), start, strict=True))
    return {"user_s": round(user, 2), "sys_s": round(sys_, 2), "sys_share": round(sys_ / user, 4) if user > 0 else 0.0}
