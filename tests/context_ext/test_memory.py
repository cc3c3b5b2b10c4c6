"""Peak-memory accounting of the context evaluation: an earlier fine-tune's peak is not its own."""

from __future__ import annotations

import sys

import pytest
import torch

from context_ext import suite


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs are Linux interfaces")
def test_reset_lowers_the_peak_to_what_is_resident() -> None:
    big = torch.ones(50_000_000)  # 200 MB touched, then freed
    big.add_(1)
    before = suite.peak_rss_gb()
    del big
    if not suite.reset_peak_rss():  # a kernel that refuses clear_refs: the peak stays the process's
        assert suite.peak_rss_gb() >= before
        return
    after = suite.peak_rss_gb()
    assert after < before - 0.15, (before, after)
    # the count runs on from there: a new allocation raises it again
    again = torch.ones(50_000_000)
    again.add_(1)
    assert suite.peak_rss_gb() > after + 0.15
    del again
