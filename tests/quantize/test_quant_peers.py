"""Independent libraries read Warsha's exports (slow; needs the peer venv).

GPTQModel loads Warsha's GPTQ-v1 and AWQ-GEMM checkpoints with its own CPU kernels, and every
integer code it decodes must be the one Warsha wrote (``python -m benchmarks.peers.gptqmodel_load``).
llm-compressor quantizes the same tiny model through ``benchmarks/peers/llmcompressor_quant.py``
(the driver ``python -m benchmarks.quant_bench`` uses), and the result must be on a 4-bit grid.
Given the same weight, Hessian and group grid, llm-compressor's GPTQ solver
(``benchmarks/peers/llmcompressor_gptq_layer.py``) and Warsha's give the same codes.

The peer venv is created by ``bash benchmarks/peers/make_venv.sh`` (default
``/work/venvs/peers``; ``WARSHA_PEER_PYTHON`` points elsewhere). Run with
``.venv/bin/python -m pytest tests/quantize/test_quant_peers.py -m slow``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from quantize.arch import arch_for
from quantize.awq import AWQOptions
from quantize.export import export, quantization_config
from quantize.gptq import GPTQOptions
from quantize.layerwise import awq_method, capture_layer0, gptq_method, plan_layers, quantize_layers
from quantize.quantizer import QuantSpec

ROOT = Path(__file__).resolve().parents[2]
PEER_PYTHON = Path(os.environ.get("WARSHA_PEER_PYTHON", "/work/venvs/peers/bin/python"))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not PEER_PYTHON.is_file(),
        reason=f"peer venv absent ({PEER_PYTHON}): create it with"
        " `bash benchmarks/peers/make_venv.sh` (torch 2.13.0 CPU, llmcompressor 0.14.0.1, gptqmodel 7.6.0)",
    ),
]


def _export(
    model_dir: Path, out: Path, method: str, fmt: str, spec: QuantSpec, on_bad: str = "error", **opts: Any
) -> Path:
    """Quantize the saved tiny model with Warsha and write the checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    arch = arch_for("llama")
    plan = plan_layers(model, arch, spec, fmt, on_bad)
    ids = torch.randint(3, model.config.vocab_size, (8, 48), generator=torch.Generator().manual_seed(1))
    calib = capture_layer0(model, arch, ids, 4, "cpu", torch.float32)
    fn = gptq_method(arch, spec, GPTQOptions(**opts)) if method == "gptq" else awq_method(arch, spec, AWQOptions(), {})
    quantized = quantize_layers(model, arch, plan, fn, calib, "cpu", method)
    extra = {"desc_act": bool(opts.get("act_order")), "static_groups": opts.get("static_groups", True)}
    export(
        model,
        quantized,
        model_dir,
        out,
        quantization_config(fmt, spec.bits, spec.group_size, spec.sym, sorted(plan.skipped), extra),
    )
    return out


@pytest.mark.parametrize(
    "method,fmt,sym,opts",
    [
        ("gptq", "gptq", True, {}),
        ("gptq", "gptq", True, {"act_order": True, "static_groups": False}),  # a permuted g_idx
        ("awq", "awq", False, {}),
    ],
)
def test_gptqmodel_reads_every_code(
    model_dir: Path, tmp_path: Path, method: str, fmt: str, sym: bool, opts: dict
) -> None:
    export_dir = _export(model_dir, tmp_path / "q", method, fmt, QuantSpec(4, 32, sym), **opts)
    report_path = tmp_path / "report.json"
    res = subprocess.run(
        [
            str(PEER_PYTHON),
            "-m",
            "benchmarks.peers.gptqmodel_load",
            str(export_dir),
            "--out",
            str(report_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert report_path.is_file(), res.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["weights"]["linears"] == 14
    assert report["weights"]["kernels"] == (["TorchLinear"] if fmt == "gptq" else ["AwqTorchLinear"])
    assert report["weights"]["max_steps"] < 0.5  # every code, zero and scale decoded as written
    bf16_own_error = report["ref_bf16_vs_ref_fp32"]["max_abs"]  # the reference itself, run in bf16
    assert report["logits_vs_ref_fp32"]["max_abs"] <= 2 * bf16_own_error + 1e-3
    assert report["ok"] and res.returncode == 0


@pytest.mark.parametrize("method,fmt,sym", [("gptq", "gptq", True), ("awq", "awq", False)])
def test_gptqmodel_keeps_fallback_linears_in_float(
    model_dir: Path, tmp_path: Path, method: str, fmt: str, sym: bool
) -> None:
    """down_proj with 96 inputs cannot take group 64: it stays float, and GPTQModel must see that."""
    import shutil

    from tests.quantize.quant_fixtures import tiny_model

    src = tmp_path / "src"
    shutil.copytree(model_dir, src)
    tiny_model(
        seed=3, inter=96, vocab=json.loads((model_dir / "config.json").read_text())["vocab_size"]
    ).save_pretrained(src)
    export_dir = _export(src, tmp_path / "q", method, fmt, QuantSpec(4, 64, sym), on_bad="fallback")
    report_path = tmp_path / "report.json"
    res = subprocess.run(
        [
            str(PEER_PYTHON),
            "-m",
            "benchmarks.peers.gptqmodel_load",
            str(export_dir),
            "--out",
            str(report_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    report = json.loads(report_path.read_text())
    assert report["ok"] and res.returncode == 0, report.get("error")
    assert report["weights"]["linears"] == 12 and report["weights"]["max_steps"] < 0.5


def test_gptqmodel_refuses_asymmetric_gptq_v1_from_other_tools(model_dir: Path, tmp_path: Path) -> None:
    """GPTQModel's policy, recorded so a change is noticed: it refuses every sym=False GPTQ-v1
    checkpoint not written by GPTQModel >= 0.9 (old AutoGPTQ ones wrapped zero 0 to 15; Warsha
    keeps zeros >= 1, FORMAT.md). Asymmetric Warsha models go to GPTQModel in the AWQ layout."""
    export_dir = _export(model_dir, tmp_path / "q", "gptq", "gptq", QuantSpec(4, 32, False))
    report_path = tmp_path / "report.json"
    res = subprocess.run(
        [
            str(PEER_PYTHON),
            "-m",
            "benchmarks.peers.gptqmodel_load",
            str(export_dir),
            "--out",
            str(report_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    report = json.loads(report_path.read_text())
    assert res.returncode == 1 and not report["ok"]
    assert "sym=False model with format=FORMAT.GPTQ is only supported if produced by gptqmodel" in report["error"]


def test_llmcompressor_driver_quantizes_on_cpu(model_dir: Path, tmp_path: Path) -> None:
    job = tmp_path / "job.pt"
    torch.save(
        {
            "model": str(model_dir),
            "calib": torch.randint(3, 600, (4, 32), generator=torch.Generator().manual_seed(0)),
            "bits": 4,
            "group_size": 32,
            "methods": ["gptq", "awq"],
            "ignore": [],
            "threads": 1,
        },
        job,
    )
    res = subprocess.run(
        [
            str(PEER_PYTHON),
            str(ROOT / "benchmarks" / "peers" / "llmcompressor_quant.py"),
            str(job),
            str(tmp_path / "lc"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((tmp_path / "lc" / "result.json").read_text())
    from transformers import AutoModelForCausalLM

    for method in ("gptq", "awq"):
        assert "error" not in result[method], result[method]
        assert 2 <= result[method]["max_levels_per_group"] <= 16
        model = AutoModelForCausalLM.from_pretrained(result[method]["model_dir"], dtype=torch.float32)
        w = model.model.layers[0].mlp.down_proj.weight.detach().reshape(-1, 32)
        assert max(len(torch.unique(row)) for row in w[:64]) <= 16  # what gets scored is on a 4-bit grid


@pytest.mark.parametrize("group_size,in_f", [(128, 256), (32, 96)])
def test_gptq_solver_equals_llmcompressors(tmp_path: Path, group_size: int, in_f: int) -> None:
    """Same ``W``, ``H`` and static group grid: Warsha's act-order GPTQ and llm-compressor's
    ``quantize_weight`` (run in its own venv) give the same quantized weight, code for code."""
    from quantize.gptq import gptq_quantize
    from quantize.quantizer import find_params

    g = torch.Generator().manual_seed(group_size)
    w = torch.randn(48, in_f, generator=g)
    x = torch.randn(1024, in_f, generator=g) @ (
        torch.eye(in_f) + 0.3 * torch.randn(in_f, in_f, generator=g) / in_f**0.5
    )
    x[:, :3] *= 20  # outlier channels: act-order moves them first
    h = 2 * x.t() @ x / x.shape[0]
    spec = QuantSpec(4, group_size, True)
    scale = find_params(w.reshape(-1, group_size), spec)[0].reshape(w.shape[0], -1)
    torch.save(
        {
            "weight": w,
            "hessian": h,
            "scale": scale,
            "bits": 4,
            "group_size": group_size,
            "damp": 0.01,
            "actorder": "static",
        },
        tmp_path / "in.pt",
    )
    res = subprocess.run(
        [
            str(PEER_PYTHON),
            str(ROOT / "benchmarks" / "peers" / "llmcompressor_gptq_layer.py"),
            str(tmp_path / "in.pt"),
            str(tmp_path / "out.pt"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    peer = torch.load(tmp_path / "out.pt")
    assert not peer["rtn_fallback"]
    ours = gptq_quantize(w, h, spec, GPTQOptions(damp=0.01, act_order=True, static_groups=True)).dequantize()
    steps = (peer["weight"] - ours).abs() / scale.repeat_interleave(group_size, 1)
    assert float((steps > 1e-3).float().mean()) <= 1e-3, f"{int((steps > 1e-3).sum())} codes differ"
    objective = lambda q: float((x @ (w - q).t()).pow(2).mean())  # noqa: E731
    assert objective(ours) == pytest.approx(objective(peer["weight"]), rel=1e-3)
