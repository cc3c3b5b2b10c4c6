"""The three stages end to end on a tiny model and a synthetic corpus, plus their params."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from quantize.stages import STAGES, AWQParams, GPTQParams, RTNParams
from warsha.schema import from_dict

SMALL = {"group_size": 32, "eval_documents": 12, "eval_max_length": 64}
CALIB = {"n_samples": 8, "seq_len": 48, "batch_size": 4}


def test_registry_and_fast_import() -> None:
    assert {k: v.name for k, v in STAGES.items()} == {
        "awq": "quantize.awq",
        "gptq": "quantize.gptq",
        "rtn": "quantize.rtn",
        "gguf": "quantize.gguf",
    }
    code = "import sys, quantize.stages; print(any(m == 'torch' or m.startswith('transformers') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_params_report_every_problem() -> None:
    problems: list[str] = []
    from_dict(AWQParams, {"bits": 3, "group_size": 100, "on_bad_group": "skip"}, "stages[5].params", problems)
    assert "stages[5].params.group_size: must be 'auto' or a multiple of 8 >= 8, got 100" in problems
    assert any(p.startswith("stages[5].params.on_bad_group: must be one of 'error' | 'fallback'") for p in problems)
    problems = []
    from_dict(AWQParams, {"bits": 3}, "p", problems)
    assert problems == ["p.format: the AWQ GEMM layout holds 4-bit weights only, got bits=3; use format: gptq"]
    problems = []
    from_dict(GPTQParams, {"format": "awq", "desc_act": True, "static_groups": False, "damp": 0}, "p", problems)
    assert problems == ["p.damp: must be > 0.0, got 0.0"]
    problems = []
    from_dict(GPTQParams, {"format": "awq", "desc_act": True, "static_groups": False}, "p", problems)
    assert problems and "g_idx" in problems[0]


def _check_artifact(out: Path, method: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert len(AutoTokenizer.from_pretrained(out)) > 500
    return json.loads((out / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize(
    "method,params",
    [
        ("gptq", GPTQParams(**SMALL, **CALIB)),
        ("awq", AWQParams(**SMALL, **CALIB, format="gptq", n_grid=10)),
        ("rtn", RTNParams(**SMALL, format="awq", sym=False)),
    ],
)
def test_stage_runs_and_reports(make_ctx: Any, method: str, params: Any) -> None:
    ctx = make_ctx(name=method)
    m = STAGES[method].run(ctx, params)
    qc = _check_artifact(ctx.out_dir, method)
    assert qc["quant_method"] == params.format and qc["group_size"] == 32
    for lang in ("ar", "en"):
        for key in ("unquantized", "quantized"):
            assert m[key][lang]["perplexity"] > 1 and m[key][lang]["bits_per_char"] > 0
        rel = m["perplexity_increase_rel"][lang]
        assert rel == pytest.approx(m["quantized"][lang]["perplexity"] / m["unquantized"][lang]["perplexity"] - 1)
        assert abs(rel) < 0.2  # a random tiny model barely moves; a packing bug would explode it
        assert 0 < m["perplexity_increase_se"][lang] < 0.05
        if method != "rtn":
            vs = m["vs_rtn"][lang]["rel"]
            assert vs == pytest.approx(m["quantized"][lang]["perplexity"] / m["rtn"][lang]["perplexity"] - 1)
    assert m["size_bytes"] < 0.6 * m["input_size_bytes"] and m["quantize_seconds"] > 0
    assert ("rtn" in m) == (method != "rtn")


def test_stage_refuses_too_little_calibration_text(make_ctx: Any) -> None:
    ctx = make_ctx(name="big")
    with pytest.raises(ValueError, match="calibration needs n_samples x seq_len = 4000 x 512"):
        STAGES["gptq"].run(ctx, GPTQParams(**SMALL, n_samples=4000))
    assert not ctx.out_dir.exists()


def test_stage_refuses_unknown_architecture(make_ctx: Any, tmp_path: Path) -> None:
    src = tmp_path / "gpt2"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        STAGES["rtn"].run(make_ctx(src=src), RTNParams(**SMALL))


@pytest.mark.slow
def test_awq_and_gptq_stages_on_the_bundled_corpus(model_dir: Path, tmp_path: Path) -> None:
    """End to end on real hadith text (the demo extra), group 64, with the RTN comparison."""
    from tests.quantize.quant_fixtures import FakeContext
    from warsha.data import DataConfig, load_corpus

    corpus = load_corpus(DataConfig(collections=["bukhari"], max_documents=3000))
    for method, params in (
        ("awq", AWQParams(group_size=64, n_samples=16, seq_len=128, eval_documents=30, eval_max_length=128)),
        (
            "gptq",
            GPTQParams(group_size=64, n_samples=16, seq_len=128, eval_documents=30, eval_max_length=128, desc_act=True),
        ),
    ):
        ctx = FakeContext(model_dir=model_dir, out_dir=tmp_path / method, the_corpus=corpus)
        m = STAGES[method].run(ctx, params)
        assert set(m["perplexity_increase_rel"]) == {"ar", "en"}
        assert m["rtn"]["ar"]["tokens"] == m["quantized"]["ar"]["tokens"] > 1000


def test_export_carries_the_files_serving_reads(tmp_path: Path) -> None:
    """A quantized draft keeps its draft_vocab.json: without it serve scores the whole vocabulary."""
    from quantize.export import copy_side_files

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "draft_vocab.json", "config.json", "model.safetensors"):
        (src / name).write_text("{}")
    assert copy_side_files(src, out) == ["draft_vocab.json", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in out.iterdir()) == ["draft_vocab.json", "tokenizer.json", "tokenizer_config.json"]


def test_export_keeps_unquantized_tensors_in_the_serving_dtype(make_ctx: Any) -> None:
    """bfloat16 by default (recorded in the manifest and config.json); serve and transformers
    (through the dequantizing reader) load it and agree on greedy tokens in float32."""
    import torch

    from quantize.dequant import load_dequantized, read_safetensors
    from serve.engine import LLM
    from serve.sampler import SamplingParams

    ctx = make_ctx(name="bf16")
    m = STAGES["rtn"].run(ctx, RTNParams(**SMALL))
    wide = make_ctx(name="f32")
    m32 = STAGES["rtn"].run(wide, RTNParams(**SMALL, save_dtype="auto"))
    assert (m["save_dtype"], m32["save_dtype"]) == ("bfloat16", "float32")
    assert json.loads((ctx.out_dir / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = read_safetensors(ctx.out_dir)
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["model.norm.weight"].dtype == torch.bfloat16
    float_bytes = sum(t.numel() for n, t in tensors.items() if t.dtype == torch.bfloat16) * 2
    saved = m32["size_bytes"] - m["size_bytes"]
    assert abs(saved - float_bytes) < 256  # the float tensors, half as wide (up to the header's text)
    prompts = [[0, 5 + i, 40 + 3 * i, 200 + i] for i in range(3)]
    engine = LLM(ctx.out_dir, dtype="float32", int4_activations="float")
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    ref = load_dequantized(ctx.out_dir, torch.float32)
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            ids = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
            assert out.token_ids == ids[0, len(prompt) :].tolist()


def test_export_stores_the_embedding_in_int8_rows(make_ctx: Any) -> None:
    """``embedding_bits: 8``: embedding and (untied) head as int8 rows with one float32 scale each,
    half the bytes; each weight within half a step of its row (checked in float64); the stage
    scores what it wrote; serve and transformers (through the dequantizing reader) agree."""
    import torch

    from quantize.dequant import load_dequantized, read_safetensors
    from serve.engine import LLM
    from serve.sampler import SamplingParams

    ctx16, ctx8 = make_ctx(name="e16"), make_ctx(name="e8")
    m16 = STAGES["rtn"].run(ctx16, RTNParams(**SMALL))
    m8 = STAGES["rtn"].run(ctx8, RTNParams(**SMALL, embedding_bits=8))
    assert (m16["embedding_bits"], m8["embedding_bits"]) == (16, 8)
    qc = json.loads((ctx8.out_dir / "config.json").read_text())["quantization_config"]
    assert qc["embedding_bits"] == 8 and "embedding_bits" not in _check_artifact(ctx16.out_dir, "rtn")
    tensors, src = read_safetensors(ctx8.out_dir), read_safetensors(ctx8.model_dir)
    for module in ("model.embed_tokens", "lm_head"):
        assert f"{module}.weight" not in tensors
        q, scale = tensors[f"{module}.weight_int8"], tensors[f"{module}.weight_scale"]
        assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == q.shape[:1]
        w = src[f"{module}.weight"].double()
        step = w.abs().amax(dim=1) / 127
        assert torch.allclose(scale.double(), step, rtol=1e-6)
        assert (q.double() * step[:, None] - w).abs().le(step[:, None] / 2 * (1 + 1e-5)).all()
        assert q.abs().amax(dim=1).eq(127).all()  # each row uses its whole range
    rows, cols = tensors["model.embed_tokens.weight_int8"].shape
    saved = m16["size_bytes"] - m8["size_bytes"]
    assert abs(saved - 2 * (rows * cols - 4 * rows)) < 512  # two bf16 tables -> int8 + float32 scales
    for lang in ("ar", "en"):
        assert abs(m8["perplexity_increase_rel"][lang] - m16["perplexity_increase_rel"][lang]) < 0.01
    prompts = [[0, 5 + i, 40 + 3 * i, 200 + i] for i in range(3)]
    engine = LLM(ctx8.out_dir, dtype="float32", int4_activations="float")
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    ref = load_dequantized(ctx8.out_dir, torch.float32)
    q, scale = tensors["model.embed_tokens.weight_int8"], tensors["model.embed_tokens.weight_scale"]
    assert torch.equal(ref.model.embed_tokens.weight, q.float() * scale[:, None])
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            ids = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
            assert out.token_ids == ids[0, len(prompt) :].tolist()


def test_serve_loads_the_awq_gemm_layout(make_ctx: Any) -> None:
    """An asymmetric AWQ-GEMM export (what vLLM's CPU backend loads): serve repacks it into GPTQ v2
    words at load (`serve.awq`), its int4 weights equal the dequant reference's float32 weights,
    and its greedy tokens equal transformers' on the dequantized model."""
    import torch

    from quantize.dequant import load_dequantized, read_safetensors
    from serve.awq import awq_to_gptq_state
    from serve.engine import LLM
    from serve.quant import gptq_dequantize
    from serve.sampler import SamplingParams

    ctx = make_ctx(name="awq_gemm")
    STAGES["rtn"].run(ctx, RTNParams(**SMALL, format="awq", sym=False))
    assert _check_artifact(ctx.out_dir, "rtn")["quant_method"] == "awq"
    ref = load_dequantized(ctx.out_dir, torch.float32)
    state = awq_to_gptq_state(read_safetensors(ctx.out_dir))
    name = "model.layers.1.mlp.down_proj"
    g_idx = torch.arange(state[f"{name}.qweight"].shape[0] * 8) // 32
    w = gptq_dequantize(state[f"{name}.qweight"], state[f"{name}.qzeros"], state[f"{name}.scales"], g_idx, "gptq_v2")
    assert torch.equal(w, ref.get_submodule(name).weight)
    prompts = [[0, 5 + i, 40 + 3 * i, 200 + i] for i in range(3)]
    engine = LLM(ctx.out_dir, dtype="float32", int4_activations="float")
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            ids = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
            assert out.token_ids == ids[0, len(prompt) :].tolist()
