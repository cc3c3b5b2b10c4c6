"""``quantize.outliers`` (``python -m benchmarks.outlier_standin``): the float model is unchanged, the
quantization problem is not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantize import outliers as mod
from quantize.quantizer import QuantSpec, quantize_rtn
from tests.quantize.quant_fixtures import tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind", ["weight", "activation"])
def test_logits_unchanged_in_float64(kind: str) -> None:
    model = tiny_model(seed=3, outliers=False).double()
    ids = torch.randint(2, 600, (2, 24))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        mod.inject_outliers(model, [5, 17, 90], 10.0, kind)
        after = model(input_ids=ids).logits
    assert torch.allclose(before, after, rtol=1e-10, atol=1e-10)


def test_weight_outliers_make_rtn_output_error_grow() -> None:
    """The point of the stand-in: RTN's error on the fed linears' outputs rises by a large factor."""
    model = tiny_model(seed=4, outliers=False)
    layer = model.model.layers[0]
    x = torch.randn(64, model.config.hidden_size)

    @torch.no_grad()
    def rtn_error() -> float:
        normed = layer.input_layernorm(x)
        w = layer.self_attn.q_proj.weight.data
        deq = quantize_rtn(w, QuantSpec(4, 32, True)).dequantize()
        return float((normed @ (deq - w).T).pow(2).mean())

    plain = rtn_error()
    mod.inject_outliers(model, [1, 40, 77], 10.0, "weight")
    assert rtn_error() > 5 * plain


def test_only_the_chosen_channels_move() -> None:
    model = tiny_model(seed=5, outliers=False)
    layer = model.model.layers[1]
    norm0, up0 = layer.post_attention_layernorm.weight.clone(), layer.mlp.up_proj.weight.clone()
    mod.inject_outliers(model, [7], 4.0, "weight")
    assert torch.allclose(layer.post_attention_layernorm.weight[7], norm0[7] / 4)
    assert torch.allclose(layer.mlp.up_proj.weight[:, 7], up0[:, 7] * 4)
    others = [c for c in range(norm0.numel()) if c != 7]
    assert torch.equal(layer.post_attention_layernorm.weight[others], norm0[others])
    assert torch.equal(layer.mlp.up_proj.weight[:, others], up0[:, others])


def test_bad_arguments_name_the_option() -> None:
    model = tiny_model(seed=6, outliers=False)
    with pytest.raises(ValueError, match="--magnitude"):
        mod.inject_outliers(model, [1], 0.0)
    with pytest.raises(ValueError, match="--kind"):
        mod.inject_outliers(model, [1], 2.0, "bias")
    with pytest.raises(ValueError, match="--channels"):
        mod.pick_channels(128, 129, 0)
    assert mod.pick_channels(128, 4, 0) == mod.pick_channels(128, 4, 0)


def test_refuses_to_overwrite_an_existing_output(tmp_path: Path) -> None:
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.outlier_standin", "--model", str(tmp_path), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode != 0 and "--out" in run.stderr and "exists" in run.stderr
    assert (out / "keep.txt").read_text() == "mine"
