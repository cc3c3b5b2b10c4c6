"""serve.hugepages: weights copied onto huge-page mappings keep their values; the switch and the
THP setting are honoured; the mapping really carries the kernel's huge-page advice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serve import hugepages
from serve.kv_cache import KVCache


def _smaps(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields (name -> rest of the line) of the mapping that holds `address`."""
    fields: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            if fields is not None:
                return fields
            lo, hi = (int(x, 16) for x in head.split("-"))
            fields = {} if lo <= address < hi else None
        elif fields is not None and ":" in line:
            name, rest = line.split(":", 1)
            fields[name] = rest.strip()
    if fields is None:
        raise AssertionError(f"no mapping holds {address:#x}")
    return fields


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    return _smaps(address)["VmFlags"].split()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.int8])
def test_place_keeps_values_dtype_and_shape(dtype: torch.dtype) -> None:
    src = (torch.randn(700, 300) * 50).to(dtype)
    out = hugepages.place(src)
    assert out.dtype == dtype and out.shape == src.shape and out.is_contiguous()
    assert torch.equal(out, src)
    if hugepages.enabled():
        assert out.data_ptr() != src.data_ptr() and out.data_ptr() % hugepages.ALIGN == 0
        assert hugepages.placed(out) and hugepages.placed(out[10:20]) and not hugepages.placed(src)
        assert hugepages.place(out) is out  # placed once
        assert "hg" in _vm_flags(out.data_ptr())  # advised MADV_HUGEPAGE
    else:
        assert out is src


def test_place_copies_a_non_contiguous_tensor_into_row_order() -> None:
    src = torch.randn(300, 700).T
    out = hugepages.place(src)
    assert torch.equal(out, src) and out.is_contiguous()


def test_place_leaves_small_tensors_and_other_devices_alone() -> None:
    small = torch.randn(16)
    assert hugepages.place(small) is small
    meta = torch.empty(4096, 4096, device="meta")
    assert hugepages.place(meta) is meta


def test_the_switch_and_the_thp_setting_turn_placement_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    src = torch.randn(512, 512)
    monkeypatch.setenv(hugepages.ENV, "0")
    assert not hugepages.enabled() and hugepages.place(src) is src
    monkeypatch.delenv(hugepages.ENV)
    setting = tmp_path / "enabled"
    for text, mode in (("always madvise [never]\n", "never"), ("[always] madvise never\n", "always"), ("", "absent")):
        setting.write_text(text)
        monkeypatch.setattr(hugepages, "THP_SETTING", setting)
        assert hugepages.thp_mode() == mode
        assert hugepages.enabled() == (mode == "always")
    monkeypatch.setattr(hugepages, "THP_SETTING", tmp_path / "missing")
    assert hugepages.thp_mode() == "absent" and not hugepages.enabled()
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(hugepages, "THP_SETTING", setting)
    z = hugepages.zeros((4, 1 << 20), torch.bfloat16)
    assert not hugepages.placed(z) and not bool(z.any())


def test_kv_cache_is_zeroed_and_on_huge_pages_where_enabled() -> None:
    kv = KVCache(2, 64, 16, 4, 256, torch.bfloat16)  # 2 x 2 MiB: big enough to place
    assert kv.k.shape == (2, 4, 1024, 256) and not bool(kv.k.any()) and not bool(kv.v.any())
    assert hugepages.placed(kv.k) == hugepages.enabled() == hugepages.placed(kv.v)
    kv.write(
        1,
        torch.tensor([5, 900]),
        torch.ones(2, 4, 256, dtype=torch.bfloat16),
        torch.ones(2, 4, 256, dtype=torch.bfloat16),
    )
    assert float(kv.k[1, :, [5, 900]].sum()) == 2 * 4 * 256 and float(kv.k.sum()) == 2 * 4 * 256
    tiny = KVCache(1, 2, 16, 1, 8, torch.float32)  # below one huge page: plain torch memory
    assert not hugepages.placed(tiny.k)


@pytest.mark.skipif(not hugepages.enabled(), reason="huge-page placement is off on this host")
def test_kv_cache_pages_are_resident_before_the_first_step() -> None:
    """Every page of the cache is faulted in at allocation (as torch.zeros does), so no serving
    step pays a first write's page fault: the mapping's resident size covers the whole cache."""
    kv = KVCache(4, 256, 16, 2, 128, torch.bfloat16)  # 4 MiB each for K and V
    for t in (kv.k, kv.v):
        rss_kb = int(_smaps(t.data_ptr())["Rss"].split()[0])
        assert rss_kb * 1024 >= t.nbytes, f"{rss_kb} KiB resident of {t.nbytes // 1024}"
