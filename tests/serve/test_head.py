"""serve.head: the sliced bf16 LM head and the reused logits buffer, against one whole GEMM.

The reference is `DenseLinear` over the whole bf16 weight, its bf16 output widened to float32
(what the engine computed before the head was sliced): the sliced head must give the same bits
for every batch size, with and without an output buffer, whatever the slice width.
"""

from __future__ import annotations

import pytest
import torch

from serve.head import LogitsBuffer, SlicedHead
from serve.quant import DenseLinear


def weight(vocab: int = 1000, hidden: int = 64, seed: int = 0) -> torch.Tensor:
    return (torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16()


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 70])
@pytest.mark.parametrize("slice_rows", [128, 300, 1000, 4096])
def test_sliced_head_gives_the_whole_gemms_bits(rows: int, slice_rows: int) -> None:
    w = weight()
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).bfloat16()
    want = DenseLinear(w)(x).float()
    head = SlicedHead(w, slice_rows=slice_rows)
    got = head(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 1000)
    assert torch.equal(got, want)
    out = torch.full((rows, 1000), float("nan"))
    assert head(x, out) is out and torch.equal(out, want)


def test_sliced_head_takes_only_bf16_cpu_weights() -> None:
    with pytest.raises(ValueError, match="bf16 CPU weight"):
        SlicedHead(weight().float())


def test_logits_buffer_grows_and_hands_out_views_of_one_storage() -> None:
    buf = LogitsBuffer()
    a = buf.take(4, 10)
    assert a.shape == (4, 10) and a.dtype == torch.float32
    b = buf.take(2, 10)  # smaller: the same memory
    assert b.data_ptr() == a.data_ptr()
    c = buf.take(8, 10)  # larger: a new buffer, the old view untouched
    assert c.shape == (8, 10) and c.numel() == 80
    big = buf.take(3, 20)
    assert big.data_ptr() == c.data_ptr() and big.is_contiguous()


def test_engine_with_the_sliced_head_and_reused_buffer_decodes_as_with_the_whole_head(
    tiny_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy continuations of 6 requests in bf16: slices of 37 rows and the step-to-step logits
    buffer (forced on any CPU) against the plain head, token for token."""
    import serve.model as sm
    from serve import LLM, SamplingParams

    prompts = [[5 + i, 9, 14 + 2 * i, 3, 7][: 2 + i % 4] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for _ in prompts]
    plain = LLM(tiny_dir, dtype="bfloat16", kv_cache_memory_gb=0.05)
    assert not isinstance(plain.runner.target.head, SlicedHead)  # a tiny vocabulary: one GEMM
    want = [o.token_ids for o in plain.generate(prompts, params)]
    monkeypatch.setattr(sm, "SLICE_ROWS", 37)
    monkeypatch.setattr(sm, "upcast_bf16_default", lambda *a, **k: False)
    sliced = LLM(tiny_dir, dtype="bfloat16", kv_cache_memory_gb=0.05)
    assert isinstance(sliced.runner.target.head, SlicedHead)
    assert [o.token_ids for o in sliced.generate(prompts, params)] == want
