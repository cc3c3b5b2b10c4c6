"""bf16 is chosen only where the hardware computes it fast; an explicit recipe choice wins."""

from __future__ import annotations

import pytest
import torch

from warsha import precision
from warsha.training import TrainParams, make_accelerator


def _cpu_has_native_bf16() -> bool:
    """Independent reading of the CPU flags (Linux), not torch's probes."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    return "avx512_bf16" in flags or "amx_tile" in flags


def test_auto_follows_the_cpu_flags() -> None:
    assert precision.bf16_is_fast("cpu") == _cpu_has_native_bf16()
    expected = torch.bfloat16 if _cpu_has_native_bf16() else torch.float32
    assert precision.compute_dtype(None, "cpu") == expected
    assert precision.dtype_name(None, "cpu") == str(expected).removeprefix("torch.")


@pytest.mark.parametrize("flag", [True, False])
def test_an_explicit_choice_wins(flag: bool) -> None:
    assert precision.use_bf16(flag, "cpu") is flag
    assert precision.compute_dtype(flag) == (torch.bfloat16 if flag else torch.float32)


def test_trainer_default_resolves_by_hardware() -> None:
    acc = make_accelerator("cpu", TrainParams())
    assert acc.mixed_precision == ("bf16" if _cpu_has_native_bf16() else "no")
    assert make_accelerator("cpu", TrainParams(bf16=False)).mixed_precision == "no"
