"""The allocator and thread policy: applied, resolved by its one rule, validated, and recorded."""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from serve import runtime as serve_runtime
from tests.conftest import tiny_recipe
from warsha import runtime
from warsha.artifacts import read_manifest
from warsha.config import RecipeError, parse_recipe

GLIBC = platform.libc_ver()[0] == "glibc"


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process state with no policy applied yet and no thread variables; torch's count restored."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(runtime, "_active", {})
    for key in ("OMP_NUM_THREADS", "WARSHA_ALLOCATOR"):
        monkeypatch.delenv(key, raising=False)
    yield
    torch.set_num_threads(threads)


def _mmapped_bytes() -> int:
    """glibc's own count of bytes held in mmap'ed chunks (``mallinfo2().hblkhd``)."""

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd")] + [
            (name, ctypes.c_size_t) for name in ("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
        ]

    fn = ctypes.CDLL(None).mallinfo2
    fn.restype = MallInfo2
    return fn().hblkhd


@pytest.mark.skipif(not GLIBC or not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc 2.33+ only")
def test_tuned_glibc_keeps_a_64mib_block_off_mmap(fresh: None) -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    info = runtime.apply(allocator="glibc-tuned")
    assert info["allocator"] == "glibc-tuned" and info["allocator_source"] == "recipe"
    before = _mmapped_bytes()
    block = libc.malloc(64 << 20)  # glibc's default would mmap this (its threshold is at most 32 MiB)
    try:
        assert _mmapped_bytes() == before
    finally:
        libc.free(block)
    huge = libc.malloc((1 << 30) + (1 << 20))  # at or above 1 GiB: still mapped, so returned on free
    try:
        assert _mmapped_bytes() >= before + (1 << 30)
    finally:
        libc.free(huge)
    assert _mmapped_bytes() == before


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_tuned_policy_is_exported_to_child_processes(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        monkeypatch.delenv(name, raising=False)
    runtime.apply()
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == str(1 << 30)
    assert int(os.environ["MALLOC_TRIM_THRESHOLD_"]) >= 1 << 30
    assert int(os.environ["MALLOC_TOP_PAD_"]) > 0


def test_system_allocator_leaves_libc_alone(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    called = []
    monkeypatch.setattr(runtime, "tune_glibc", lambda: called.append(1) or True)
    monkeypatch.setenv("WARSHA_ALLOCATOR", "system")
    info = runtime.apply(allocator="glibc-tuned")  # the environment wins over the recipe
    assert info["allocator"] == "system" and info["allocator_source"] == "WARSHA_ALLOCATOR"
    assert called == [] and "malloc" not in info


def test_allocator_is_set_once_per_process(fresh: None) -> None:
    runtime.apply(allocator="glibc-tuned")
    assert runtime.apply(allocator="system")["allocator"] == ("glibc-tuned" if GLIBC else "system")


def test_bad_environment_values_are_named(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARSHA_ALLOCATOR", "jemalloc")
    with pytest.raises(runtime.RuntimeConfigError, match="WARSHA_ALLOCATOR"):
        runtime.apply()
    monkeypatch.delenv("WARSHA_ALLOCATOR")
    for bad in ("0", "-2", "two"):
        monkeypatch.setenv("OMP_NUM_THREADS", bad)
        with pytest.raises(runtime.RuntimeConfigError, match="OMP_NUM_THREADS"):
            runtime.apply()


def test_thread_rule(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert runtime.apply()["threads"] == runtime.physical_cores()
    assert runtime.describe()["threads_source"] == "physical cores"
    info = runtime.apply(threads=1)
    assert (info["threads"], info["threads_source"], torch.get_num_threads()) == (1, "recipe", 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # respected over the recipe
    info = runtime.apply(threads=1)
    assert (info["threads"], info["threads_source"], torch.get_num_threads()) == (3, "OMP_NUM_THREADS", 3)


def test_physical_cores_counts_within_the_affinity_mask() -> None:
    assert 1 <= runtime.physical_cores() <= len(os.sched_getaffinity(0))
    assert serve_runtime.physical_cores() == runtime.physical_cores()


@pytest.mark.parametrize("bad", [0, -1, "two", 1.5, True])
def test_threads_field_is_validated(bad: object) -> None:
    with pytest.raises(RecipeError, match=r"threads"):
        parse_recipe({**tiny_recipe(), "threads": bad})


def test_allocator_field_is_validated() -> None:
    with pytest.raises(RecipeError, match=r"allocator: expected .glibc-tuned. | .system."):
        parse_recipe({**tiny_recipe(), "allocator": "tcmalloc"})
    assert parse_recipe({**tiny_recipe(), "threads": 2, "allocator": "system"}).threads == 2


def test_manifest_records_the_runtime(tiny_artifact: Path) -> None:
    manifest = read_manifest(tiny_artifact)
    assert manifest is not None
    rt = manifest["runtime"]
    assert rt["allocator"] in runtime.ALLOCATORS and rt["threads"] >= 1
    assert rt["threads_source"] in ("OMP_NUM_THREADS", "recipe", "physical cores")


def test_serve_thread_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert serve_runtime.thread_count(None) == serve_runtime.physical_cores()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert serve_runtime.thread_count(None) == 1
    assert serve_runtime.thread_count(3) == 3  # the --threads flag is explicit
    with pytest.raises(ValueError, match="--threads"):
        serve_runtime.thread_count(0)
    monkeypatch.setenv("WARSHA_ALLOCATOR", "system")
    assert serve_runtime.tune_allocator() == "system"
    monkeypatch.setenv("WARSHA_ALLOCATOR", "bogus")
    with pytest.raises(ValueError, match="WARSHA_ALLOCATOR"):
        serve_runtime.tune_allocator()
