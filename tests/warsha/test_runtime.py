"""The allocator and thread policy: applied, resolved by its one rule, validated, and recorded."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from serve import cpu_kernels, hugepages
from serve import runtime as serve_runtime
from tests.conftest import tiny_recipe
from warsha import runtime
from warsha.artifacts import read_manifest
from warsha.config import RecipeError, parse_recipe

GLIBC = platform.libc_ver()[0] == "glibc"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process state with no policy applied yet and no thread variables; torch's count restored."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(runtime, "_active", {})
    for key in ("OMP_NUM_THREADS", "WARSHA_ALLOCATOR"):
        monkeypatch.delenv(key, raising=False)
    yield
    torch.set_num_threads(threads)


# Run in a child with a clean environment: the test session itself runs under tcmalloc where it is
# installed (conftest), and a process cannot change allocator once it has one.
PROBE = """
import ctypes, json, os, sys
from warsha import runtime
from serve import runtime as base
info = runtime.apply(allocator=sys.argv[1] or None, reexec=sys.argv[2] == "1")
out = {"info": info, "loaded": base.tcmalloc_loaded(), "env": {k: v for k, v in os.environ.items()
       if k.startswith("MALLOC_") or k in ("LD_PRELOAD", "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD")}}
libc = ctypes.CDLL(None)
if info["allocator"] == "glibc-tuned":
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(64 << 20)  # glibc's default would mmap this (its threshold is at most 32 MiB)
    out["mmapped_64mib"] = libc.mallinfo2().hblkhd - before
    huge = libc.malloc((1 << 30) + (1 << 20))  # at or above 1 GiB: still mapped, so returned on free
    out["mmapped_1gib"] = libc.mallinfo2().hblkhd - before
    libc.free(huge); libc.free(block)
    out["mmapped_after_free"] = libc.mallinfo2().hblkhd - before
print(json.dumps(out))
"""


def _probe(allocator: str = "", reexec: bool = False, **env: str) -> dict:
    """``runtime.apply`` in a fresh interpreter started with no allocator policy in its environment."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "TCMALLOC_")) and k != "LD_PRELOAD"}
    for key in ("WARSHA_ALLOCATOR", serve_runtime.REEXEC_MARK, serve_runtime.TCMALLOC_ENV):
        clean.pop(key, None)
    cmd = [sys.executable, "-c", PROBE, allocator, "1" if reexec else "0"]
    done = subprocess.run(cmd, env={**clean, **env}, cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_tuned_glibc_keeps_a_64mib_block_off_mmap_and_exports_its_policy() -> None:
    out = _probe("glibc-tuned")
    assert out["info"]["allocator"] == "glibc-tuned" and out["info"]["allocator_source"] == "recipe"
    assert out["mmapped_64mib"] == 0 and out["mmapped_1gib"] >= 1 << 30 and out["mmapped_after_free"] == 0
    assert out["env"]["MALLOC_MMAP_THRESHOLD_"] == str(1 << 30) and int(out["env"]["MALLOC_TOP_PAD_"]) > 0


def test_system_allocator_leaves_libc_alone() -> None:
    out = _probe("glibc-tuned", WARSHA_ALLOCATOR="system")  # the environment wins over the recipe
    assert out["info"]["allocator"] == "system" and out["info"]["allocator_source"] == "WARSHA_ALLOCATOR"
    assert not out["env"] and out["loaded"] is None and "malloc" not in out["info"]


def test_default_falls_back_to_glibc_tuned_without_tcmalloc() -> None:
    out = _probe(reexec=True, **{serve_runtime.TCMALLOC_ENV: "/nonexistent/libtcmalloc_minimal.so.4"})
    assert out["info"]["allocator"] == "glibc-tuned" and out["info"]["allocator_source"] == "default"
    assert out["loaded"] is None and "LD_PRELOAD" not in out["env"]


def test_default_is_tcmalloc_where_installed_preloaded_by_one_restart() -> None:
    library = serve_runtime.find_tcmalloc()
    out = _probe(reexec=True)
    if library is None:  # hosts without the package fall back, and say so in the manifest
        assert out["info"]["allocator"] == "glibc-tuned" and out["loaded"] is None
        return
    assert out["info"]["allocator"] == "tcmalloc" and out["info"]["allocator_source"] == "default"
    assert out["loaded"] and Path(out["loaded"]).name.startswith("libtcmalloc") and out["info"]["library"]
    assert out["env"]["LD_PRELOAD"].split()[0] == library  # children (torchrun, deepspeed) inherit it
    assert "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD" in out["env"]  # no stderr line per large block


def test_a_library_call_never_restarts_the_process() -> None:
    if serve_runtime.find_tcmalloc() is None:  # `make` installs it as root; elsewhere the fallback is the default
        assert _probe(reexec=True)["info"]["allocator"] == "glibc-tuned"
        return
    out = _probe("tcmalloc", reexec=False)
    assert out["info"]["allocator"] == "glibc-tuned" and out["loaded"] is None
    assert out["info"]["allocator_source"] == "tcmalloc not preloaded in this process"


def test_tcmalloc_asked_for_but_missing_is_named() -> None:
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", serve_runtime.REEXEC_MARK)}
    clean.update({"WARSHA_ALLOCATOR": "tcmalloc", serve_runtime.TCMALLOC_ENV: "/nonexistent/libtcmalloc.so"})
    done = subprocess.run([sys.executable, "-c", PROBE, "", "1"], env=clean, cwd=ROOT, capture_output=True,
                          text=True, check=False)  # fmt: skip
    assert done.returncode != 0
    assert "WARSHA_ALLOCATOR=tcmalloc" in done.stderr and "libtcmalloc-minimal4" in done.stderr


def test_allocator_is_set_once_per_process(fresh: None) -> None:
    first = runtime.apply(allocator="glibc-tuned")["allocator"]
    assert runtime.apply(allocator="system")["allocator"] == first


def test_bad_environment_values_are_named(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARSHA_ALLOCATOR", "jemalloc")
    with pytest.raises(runtime.RuntimeConfigError, match="WARSHA_ALLOCATOR='jemalloc': must be one of tcmalloc"):
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
    with pytest.raises(RecipeError, match=r"allocator: expected .tcmalloc. | .glibc-tuned. | .system."):
        parse_recipe({**tiny_recipe(), "allocator": "jemalloc"})
    assert parse_recipe({**tiny_recipe(), "threads": 2, "allocator": "system"}).threads == 2


def test_manifest_records_the_runtime(tiny_artifact: Path) -> None:
    manifest = read_manifest(tiny_artifact)
    assert manifest is not None
    rt = manifest["runtime"]
    assert rt["allocator"] in runtime.ALLOCATORS and rt["threads"] >= 1
    assert rt["threads_source"] in ("OMP_NUM_THREADS", "recipe", "physical cores")
    assert rt["isa"] in (*cpu_kernels.ISAS, "none")  # the kernels' variant, chosen without building them
    assert rt["huge_pages"] == f"{'on' if hugepages.enabled() else 'off'} (THP {hugepages.thp_mode()})"


def test_serve_thread_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert serve_runtime.thread_count(None) == serve_runtime.physical_cores()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert serve_runtime.thread_count(None) == 1
    assert serve_runtime.thread_count(3) == 3  # the --threads flag is explicit
    with pytest.raises(ValueError, match="--threads"):
        serve_runtime.thread_count(0)
    monkeypatch.setenv("WARSHA_ALLOCATOR", "system")
    # a process cannot leave an allocator it already runs on: the truth is reported
    assert serve_runtime.tune_allocator() == ("tcmalloc" if serve_runtime.tcmalloc_loaded() else "system")
    monkeypatch.setenv("WARSHA_ALLOCATOR", "bogus")
    with pytest.raises(ValueError, match="WARSHA_ALLOCATOR"):
        serve_runtime.tune_allocator()


def test_cpu_time_matches_the_os_clock_and_counts_page_faults_as_system_time() -> None:
    """cpu_since agrees with os.times (an independent reading of the same clocks); touching fresh
    pages shows up as system time, which is what the manifest's sys share is there to catch."""
    import mmap

    start, ref = runtime.cpu_seconds(), os.times()
    total = 0
    while os.times().user - ref.user < 0.3:
        total += sum(range(10_000))
    for _ in range(4):  # fresh anonymous pages: each first touch is a fault the kernel zeroes
        with mmap.mmap(-1, 64 << 20) as m:
            for off in range(0, len(m), mmap.PAGESIZE):
                m[off] = 1
    cpu, now = runtime.cpu_since(start), os.times()
    assert total > 0
    assert abs(cpu["user_s"] - (now.user + now.children_user - ref.user - ref.children_user)) < 0.05
    assert abs(cpu["sys_s"] - (now.system + now.children_system - ref.system - ref.children_system)) < 0.05
    # the loop stops when os.times (10 ms ticks) shows 0.3 s: the finer clock may read a tick less
    assert cpu["user_s"] >= 0.28 and cpu["sys_s"] > 0.01
    assert cpu["sys_share"] == pytest.approx(cpu["sys_s"] / cpu["user_s"], rel=0.05)  # fields are rounded


def test_manifest_and_report_carry_each_stage_cpu_time(tiny_artifact: Path, tmp_path: Path) -> None:
    import shutil

    from warsha.report import write_report

    cpu = read_manifest(tiny_artifact)["cpu_time"]
    assert cpu["user_s"] > 0 and cpu["sys_s"] >= 0
    run = tmp_path / "run"
    shutil.copytree(tiny_artifact, run / "bootstrap")
    report = write_report(run).read_text()
    assert f"| `bootstrap` | {read_manifest(tiny_artifact)['wall_time_s']:.1f} | {cpu['user_s']:.1f} |" in report
    assert f"| **{cpu['sys_s'] / cpu['user_s']:.1%}** |" in report
