"""The int8 LM head (`head_quant="int8"`) against float64 references.

The kernel is checked against float64 `x @ (q * scale).T` on the same int8 values (rows past the
8-row chunk, K off the 32-wide blocks); the row rounding against its bound (half a step of the
row); a served model with the int8 head against the same model with its checkpoint head, logits
within the rounding's reach and greedy tokens equal on the tiny model; bad options named.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serve import LLM, SamplingParams, cpu_kernels
from serve.args import EngineArgs
from serve.head_quant import Int8Linear, quantize_rows_int8
from serve.model import DecoderModel
from tests.serve.conftest import hf_model

pytestmark = pytest.mark.skipif(
    not torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512", "AMX")), reason="the kernel needs AVX2"
)


@pytest.mark.parametrize("seed", range(4))
def test_row_rounding_stays_within_half_a_step(seed: int) -> None:
    """Half a step of the row, plus what float32's w / scale may move a value across a rounding
    boundary by (|w / scale| <= 127 at 2^-24 relative: under 2^-16 of a step)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(50, 70, generator=g) * torch.linspace(0.01, 5, 50)[:, None]
    w[3] = 0.0
    q, scale = quantize_rows_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert torch.equal(q[3], torch.zeros(70, dtype=torch.int8))
    err = (q.double() * scale.double()[:, None] - w.double()).abs()
    assert (err <= scale.double()[:, None] * (0.5 + 2.0**-16)).all()


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("n, k", [(300, 96), (77, 200), (130, 1024)])
def test_kernel_is_float32_accumulation_of_the_int8_rows(rows: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(rows * n + k)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-4
    x = torch.randn(rows, k, generator=g)
    got = cpu_kernels.gemv_int8(x, q, scale, torch.float32).double()
    xin = cpu_kernels.round_rows_int16(x).double() if cpu_kernels.int8_rounds_activations(k) else x.double()
    ref = xin @ (q.double() * scale.double()[:, None]).T
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_small_and_large_batches_compute_the_same_head() -> None:
    """Decode rows (the kernel) and a prefill batch (the float32 GEMM) agree row for row."""
    head = Int8Linear(torch.randn(500, 64))
    x = torch.randn(40, 64)
    big = head(x)
    small = torch.cat([head(x[i : i + 4]) for i in range(0, 40, 4)])
    torch.testing.assert_close(small, big, rtol=1e-5, atol=1e-5)


def test_int8_head_logits_stay_within_the_rounding_bound(tiny_dir: Path) -> None:
    ref = DecoderModel.load(tiny_dir, "float32")
    quant = DecoderModel.load(tiny_dir, "float32", head_quant="int8")
    h = torch.randn(12, ref.lm_head.shape[1])
    exact, rounded = ref.head(h), quant.head(h)
    # each logit moves by at most sum_k |h_k| * step_row / 2
    bound = h.abs().sum(-1, keepdim=True) * quant.head.scale[None, :] / 2
    assert ((exact - rounded).abs() <= bound + 1e-5).all()


def test_served_int8_head_equals_transformers_with_the_rounded_head(tiny_dir: Path) -> None:
    """The reference: transformers in float32 with lm_head.weight replaced by q * scale."""
    q, scale = quantize_rows_int8(hf_model(tiny_dir).lm_head.weight.detach())
    hf = hf_model(tiny_dir)
    with torch.no_grad():
        hf.lm_head.weight.copy_(q.float() * scale[:, None])
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 60))]
    expected = [
        hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    llm = LLM(tiny_dir, dtype="float32", head_quant="int8")
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    assert got == expected


def test_bad_head_quant_is_named_before_loading() -> None:
    with pytest.raises(ValueError, match="head_quant='int4'"):
        EngineArgs(head_quant="int4")
    with pytest.raises(ValueError, match="CPU only"):
        EngineArgs(head_quant="int8", device="cuda")


def test_checkpoint_int8_rows_are_widened_or_named() -> None:
    """An ``embedding_bits: 8`` export's pairs become ``<m>.weight = q * scale`` (float64 check);
    a pair that is not one names the tensor and what to do, before any model is built."""
    from serve.weights import widen_int8_rows

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (6, 5), dtype=torch.int8, generator=g)
    scale = torch.rand(6, generator=g) + 0.1
    out = widen_int8_rows({"m.weight_int8": q, "m.weight_scale": scale, "n.weight": torch.ones(2)}, "ckpt")
    assert sorted(out) == ["m.weight", "n.weight"]
    assert torch.allclose(out["m.weight"].double(), q.double() * scale.double()[:, None], rtol=1e-7, atol=0)
    q[:, 0] = 127  # rows that use their whole range, as the export writes them
    widened = widen_int8_rows({"m.weight_int8": q, "m.weight_scale": scale}, "ckpt")["m.weight"]
    assert torch.equal(quantize_rows_int8(widened)[0], q)  # head_quant="int8" on float32 rows: the same q
    # on bf16 rows, within one step: q * scale keeps 8 significant bits, so 127 * 2^-8 can round either way
    again = quantize_rows_int8(widened.bfloat16())[0]
    assert int((again.int() - q.int()).abs().max()) <= 1
    with pytest.raises(ValueError, match=r"ckpt: m.weight_int8 needs .* m.weight_scale.*re-export"):
        widen_int8_rows({"m.weight_int8": q}, "ckpt")
    with pytest.raises(ValueError, match=r"m.weight_int8 needs an int8"):
        widen_int8_rows({"m.weight_int8": q.float(), "m.weight_scale": scale}, "ckpt")
