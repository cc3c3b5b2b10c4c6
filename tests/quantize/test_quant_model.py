"""Whole-model behaviour: quality against RTN, export/dequant exactness, architectures and
every kind of bad input the stage must refuse clearly."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from quantize.arch import arch_for, supported_model_types
from quantize.awq import AWQOptions
from quantize.calib import calibration_ids
from quantize.dequant import load_dequantized
from quantize.export import export, quantization_config
from quantize.gptq import GPTQOptions
from quantize.layerwise import (
    awq_method,
    capture_layer0,
    check_model_finite,
    gptq_method,
    plan_layers,
    quantize_layers,
    rtn_method,
)
from quantize.quantizer import QuantSpec
from tests.quantize.quant_fixtures import tiny_model

ARCH = arch_for("llama")


def _ids(seed: int, n: int = 8, t: int = 48, vocab: int = 640) -> torch.Tensor:
    return torch.randint(2, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


def _quantize(
    model: Any,
    method: str,
    spec: QuantSpec,
    fmt: str = "gptq",
    on_bad: str = "error",
    alphas: dict | None = None,
    **opts: Any,
) -> tuple[dict, Any]:
    arch = arch_for(model.config.model_type)
    plan = plan_layers(model, arch, spec, fmt, on_bad)
    calib = None if method == "rtn" else capture_layer0(model, arch, _ids(1), 4, "cpu", torch.float32)
    fn = {
        "rtn": lambda: rtn_method(spec),
        "gptq": lambda: gptq_method(arch, spec, GPTQOptions(**opts)),
        "awq": lambda: awq_method(arch, spec, AWQOptions(**opts), {} if alphas is None else alphas),
    }[method]()
    return quantize_layers(model, arch, plan, fn, calib, "cpu", method), plan


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def base() -> Any:
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def errors(base: Any) -> dict[str, float]:
    """Mean squared logit error on held-out token rows, per method (4-bit, group 32)."""
    ids = _ids(99)
    ref = _logits(base, ids)
    out = {}
    for method in ("rtn", "gptq", "awq"):
        model = copy.deepcopy(base)
        _quantize(model, method, QuantSpec(4, 32, method == "gptq"))
        out[method] = float((_logits(model, ids) - ref).pow(2).mean())
    return out


def test_gptq_beats_rtn(errors: dict[str, float]) -> None:
    assert errors["gptq"] < errors["rtn"]


def test_awq_beats_rtn(errors: dict[str, float]) -> None:
    assert errors["awq"] < errors["rtn"]


def _roundtrip(
    model: Any,
    quantized: dict,
    plan: Any,
    tmp_path: Path,
    fmt: str,
    spec: QuantSpec,
    src: Path,
    extra: dict | None = None,
) -> None:
    """Export, load back through the dequant reference, compare logits with the fake-quant model."""
    qc = quantization_config(fmt, spec.bits, spec.group_size, spec.sym, sorted(plan.skipped), extra or {})
    export(model, quantized, src, tmp_path / "q", qc)
    loaded = load_dequantized(tmp_path / "q")
    ids = _ids(5)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


@pytest.mark.parametrize(
    "method,fmt,bits,opts",
    [
        ("gptq", "gptq", 4, {"act_order": True, "static_groups": False}),
        ("awq", "awq", 4, {}),
        ("awq", "gptq", 4, {}),
        ("rtn", "gptq", 3, {}),
    ],
)
def test_dequantized_export_equals_fake_quantized_model(
    tmp_path: Path, method: str, fmt: str, bits: int, opts: dict
) -> None:
    model = tiny_model(seed=1)
    model.save_pretrained(tmp_path / "src")
    spec = QuantSpec(bits, 32, False)
    quantized, plan = _quantize(model, method, spec, fmt, **opts)
    _roundtrip(model, quantized, plan, tmp_path, fmt, spec, tmp_path / "src", {"desc_act": bool(opts.get("act_order"))})
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == fmt and qc["bits"] == bits and qc["group_size"] == 32
    names = set(
        __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(tmp_path / "q" / "model.safetensors"))
    )
    assert "model.layers.0.mlp.down_proj.qweight" in names and "model.layers.0.mlp.down_proj.weight" not in names
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names


PRE_MLP_NORM = {"gemma3_text": "pre_feedforward_layernorm"}


@pytest.mark.parametrize("model_type,kv_heads", [("qwen2", 4), ("mistral", 2), ("qwen3", 4), ("gemma3_text", 2)])
def test_other_families_round_trip(tmp_path: Path, model_type: str, kv_heads: int) -> None:
    """Qwen2 has q/k/v biases; grouped-query attention makes v -> o scaling impossible; Qwen3 has
    per-head q/k norms; Gemma 3 has four (1 + w) norms, of which two feed linears."""
    model = tiny_model(seed=2, model_type=model_type, kv_heads=kv_heads)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):
                p.normal_()  # Qwen2 initialises them to zero; a dtype slip would then hide
    model.save_pretrained(tmp_path / "src")
    spec = QuantSpec(4, 32, False)
    alphas: dict[str, float] = {}
    quantized, plan = _quantize(model, "awq", spec, "awq", alphas=alphas)
    assert len(quantized) == 14
    feeders = {k.split(".", 3)[3] for k in alphas}
    expect = {"input_layernorm", PRE_MLP_NORM.get(model_type, "post_attention_layernorm"), "mlp.up_proj"} | (
        {"self_attn.v_proj"} if kv_heads == 4 else set()
    )
    assert feeders == expect  # v -> o only where v's output width equals o's input width
    _roundtrip(model, quantized, plan, tmp_path, "awq", spec, tmp_path / "src")


@pytest.mark.parametrize("model_type,tied", [("gemma3_text", True), ("llama", False)])
def test_int8_embedding_round_trip(tmp_path: Path, model_type: str, tied: bool) -> None:
    """Tied (Gemma 3) and untied (Llama) heads: the export's int8 rows, read back through the
    dequant reference, give the logits of the model whose embedding and head were rounded the
    same way in memory (what the stage's RTN comparison scores)."""
    from quantize.int8_rows import embedding_names, fake_quantize_embeddings

    model = tiny_model(seed=3, model_type=model_type, tied=tied)
    assert embedding_names(model) == ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    model.save_pretrained(tmp_path / "src")
    spec = QuantSpec(4, 32, True)
    quantized, plan = _quantize(model, "rtn", spec)
    qc = quantization_config("gptq", 4, 32, True, sorted(plan.skipped), {})
    export(model, quantized, tmp_path / "src", tmp_path / "q", qc, embedding_bits=8)
    before = model.get_output_embeddings().weight.detach().clone()
    fake_quantize_embeddings(model)
    moved = (model.get_output_embeddings().weight - before).abs()
    assert 0 < moved.max() <= before.abs().max() / 254 * (1 + 1e-5)
    loaded = load_dequantized(tmp_path / "q")
    ids = _ids(6)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


def test_unknown_architecture_is_refused() -> None:
    with pytest.raises(ValueError, match="'gpt2' is not supported.*gemma3_text, llama, mistral, qwen2, qwen3"):
        arch_for("gpt2")
    assert supported_model_types() == ["gemma3_text", "llama", "mistral", "qwen2", "qwen3"]


def test_bad_group_size_is_said_once_per_pattern() -> None:
    model = tiny_model(seed=3, inter=96)  # down_proj has 96 inputs: group 64 does not divide it
    with pytest.raises(ValueError) as err:
        plan_layers(model, ARCH, QuantSpec(4, 64, True), "gptq", "error")
    text = str(err.value)
    assert "2 linear(s) cannot be quantized: down_proj in all 2 layers: in_features 96 is not a multiple of" in text
    assert text.count("in_features 96") == 1


def test_bad_group_size_fallback_keeps_layers_in_float(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model(seed=3, inter=96)
    model.save_pretrained(tmp_path / "src")
    spec = QuantSpec(4, 64, True)
    with caplog.at_level(logging.WARNING, logger="warsha.quantize"):
        quantized, plan = _quantize(model, "gptq", spec, "gptq", on_bad="fallback")
    assert "stays unquantized: down_proj in all 2 layers: in_features 96" in caplog.text
    assert sorted(plan.skipped) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert len(quantized) == 12
    _roundtrip(model, quantized, plan, tmp_path, "gptq", spec, tmp_path / "src")
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["modules_to_not_convert"] == sorted(plan.skipped)
    assert r"-:^model\.layers\.0\.mlp\.down_proj$" in qc["dynamic"]


def test_nan_weight_is_named_before_work_starts() -> None:
    model = tiny_model(seed=4)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[3, 7] = float("nan")
    with pytest.raises(ValueError, match=r"weight model\.layers\.1\.self_attn\.k_proj\.weight contains NaN"):
        check_model_finite(model)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight contains NaN"):
        _quantize(model, "rtn", QuantSpec(4, 32, True))


def test_inf_activation_stops_at_the_layer() -> None:
    model = tiny_model(seed=4)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1e37)  # finite weights, overflowing outputs
    with pytest.raises(ValueError, match=r"activations of model\.layers\.0.* contains (Inf|NaN)"):
        _quantize(model, "gptq", QuantSpec(4, 32, True))


class _Tok:
    """A minimal tokenizer: one id per character (enough to test packing arithmetic)."""

    bos_token_id, eos_token_id = 0, 1

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict:
        return {"input_ids": [[2 + (ord(c) % 50) for c in t] for t in texts]}


def test_calibration_packs_short_and_long_documents() -> None:
    short = ["ab"] * 40  # each 2 tokens + BOS/EOS: far shorter than a row
    ids = calibration_ids(_Tok(), short, n_samples=4, seq_len=32)
    assert ids.shape == (4, 32) and int((ids == 0).sum()) == 32  # every short doc kept, none dropped
    long = ["x" * 500]
    ids = calibration_ids(_Tok(), long, n_samples=3, seq_len=100)
    assert ids.shape == (3, 100) and ids[0, 0] == 0 and bool((ids[1:] == 2 + ord("x") % 50).all())


def test_calibration_refuses_too_little_text() -> None:
    with pytest.raises(ValueError, match=r"needs n_samples x seq_len = 8 x 64 = 512 tokens, but .* only 40 tokens"):
        calibration_ids(_Tok(), ["abcdefgh"] * 4, n_samples=8, seq_len=64)
