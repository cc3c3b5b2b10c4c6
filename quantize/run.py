"""What a quantize stage does when it runs: load, check, calibrate, quantize, export, measure.

Metrics (per evaluation language, on the corpus's validation split): perplexity and bits per
character of the unquantized input, of the exported artifact (loaded back through the
``dequant`` reference, so the numbers describe what was written, not an in-memory model), the
relative perplexity increase with its standard error over documents (paired: the same documents
score both models), and for AWQ/GPTQ the same figures for RTN on the same model plus the paired
difference against RTN (``vs_rtn``). A 4-bit change on a small model is a fraction of a percent,
the size of the noise of a few thousand tokens: read every difference against its ``se``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from quantize.arch import ArchSpec, arch_for, decoder_layers, get_module
from quantize.awq import AWQOptions
from quantize.calib import calibration_ids, interleave
from quantize.evalstats import DocScores, relative_increase
from quantize.export import export, quantization_config, save_dtype
from quantize.gptq import GPTQOptions
from quantize.int8_rows import fake_quantize_embeddings
from quantize.layerwise import (
    Plan,
    awq_method,
    capture_layer0,
    check_model_finite,
    gptq_method,
    plan_layers,
    quantize_layers,
    rtn_method,
)
from quantize.quantizer import QuantizedLinear, QuantSpec
from quantize.shapes import advice, fitting_group_sizes
from warsha.evaluate import document_nll
from warsha.precision import use_bf16

log = logging.getLogger("warsha.quantize")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_arch(model_dir: Path) -> ArchSpec:
    """The architecture spec from ``config.json``, before any weight is loaded."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"quantize: {model_dir} has no config.json; expected an HF model directory")
    raw = json.loads(path.read_text())
    if raw.get("quantization_config"):
        raise ValueError(
            f"quantize: {model_dir} is already quantized ({raw['quantization_config'].get('quant_method')})"
        )
    return arch_for(str(raw.get("model_type")))


def load_model(model_dir: Path, dtype: torch.dtype) -> Any:
    """The float model, on CPU (layers move to the compute device one at a time)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def quantize_model(
    model: Any, arch: ArchSpec, method: str, params: Any, calib_ids: torch.Tensor | None, device: str, plan: Plan
) -> tuple[dict[str, QuantizedLinear], dict[str, Any]]:
    """Run one method over the whole model in place; returns the quantized linears and info."""
    spec = QuantSpec(params.bits, params.group_size, params.sym)
    dtype = DTYPES[params.compute_dtype]
    info: dict[str, Any] = {}
    if method == "rtn":
        return quantize_layers(model, arch, plan, rtn_method(spec), None, device, "rtn"), info
    assert calib_ids is not None
    calib = capture_layer0(model, arch, calib_ids, params.batch_size, device, dtype)
    if method == "gptq":
        opts = GPTQOptions(params.damp, params.blocksize, params.desc_act, params.static_groups)
        fn = gptq_method(arch, spec, opts)
    else:
        alphas: dict[str, float] = {}
        info["alphas"] = alphas
        fn = awq_method(
            arch,
            spec,
            AWQOptions(
                params.n_grid,
                params.max_shrink,
                clip=params.clip,
                duo_scaling=params.duo_scaling,
                search_bf16=use_bf16(params.search_bf16, device),
            ),
            alphas,
        )
    return quantize_layers(model, arch, plan, fn, calib, device, method), info


def evaluate(
    model: Any, tokenizer: Any, texts: dict[str, list[str]], params: Any, label: str, device: str = "cpu"
) -> dict[str, DocScores]:
    """Per-document likelihoods per language (on ``device``, then back to the CPU).

    Kept per document so that every perplexity change comes with its standard error.
    """
    out = {}
    model.to(device)
    for lang, docs in texts.items():
        log.info("quantize: scoring %s on %d %s documents", label, len(docs), lang)
        ids, nll = document_nll(
            model, tokenizer, docs, params.eval_max_length, params.eval_batch_size, desc=f"{label} {lang}"
        )
        out[lang] = DocScores.of(docs, ids, nll)
    model.to("cpu")
    return out


def _dicts(scores: dict[str, DocScores]) -> dict[str, dict[str, float]]:
    return {lang: s.as_dict() for lang, s in scores.items()}


def _relative(after: dict[str, DocScores], before: dict[str, DocScores]) -> dict[str, dict[str, float]]:
    """Relative perplexity change per language and its paired standard error over documents."""
    out = {}
    for lang in before:
        rel, se = relative_increase(after[lang], before[lang])
        out[lang] = {"rel": rel, "se": se}
    return out


def dir_bytes(path: Path, pattern: str = "*.safetensors") -> int:
    """Bytes of the weight files of a model directory."""
    return sum(f.stat().st_size for f in Path(path).glob(pattern))


def resolve_group_size(model: Any, arch: ArchSpec, params: Any) -> int:
    """``params.group_size``, with ``auto`` resolved to the largest of 128/64/32 that every
    quantized linear of the loaded model takes (planning checked that one exists)."""
    if params.group_size != "auto":
        return int(params.group_size)
    shapes = {
        (fc.in_features, fc.out_features)
        for layer in decoder_layers(model, arch)
        for fc in (get_module(layer, name) for name in arch.linears)
    }
    fits = fitting_group_sizes(shapes, params.bits, params.format)
    if not fits:
        raise ValueError(f"quantize: group_size auto: {advice('auto', fits)}")
    log.info("quantize: group_size auto -> %d", fits[0])
    return fits[0]


def resolve_device(device: str) -> str:
    """``auto`` means the first GPU when there is one (layers visit it one at a time)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def run_awq(ctx: Any, params: Any) -> dict[str, Any]:
    """Entry point of ``quantize.awq``."""
    return run_stage(ctx, params, "awq")


def run_gptq(ctx: Any, params: Any) -> dict[str, Any]:
    """Entry point of ``quantize.gptq``."""
    return run_stage(ctx, params, "gptq")


def run_rtn(ctx: Any, params: Any) -> dict[str, Any]:
    """Entry point of ``quantize.rtn``."""
    return run_stage(ctx, params, "rtn")


def run_stage(ctx: Any, params: Any, method: str) -> dict[str, Any]:
    """The work of the three stages, which differ only in the method."""
    from transformers import AutoTokenizer

    src = Path(ctx.model_dir)
    device = resolve_device(ctx.device)
    arch = model_arch(src)
    corpus = ctx.corpus()
    eval_texts = {lang: corpus.texts(lang, "validation")[: params.eval_documents] for lang in params.eval_langs}
    for lang, docs in eval_texts.items():
        if not docs:
            raise ValueError(f"quantize: the corpus has no {lang!r} documents in the validation split; fix eval_langs")
    tokenizer = AutoTokenizer.from_pretrained(src)
    calib_ids = None
    if method != "rtn":
        texts = interleave([corpus.texts(lang, "train") for lang in params.calib_langs], ctx.seed)
        calib_ids = calibration_ids(tokenizer, texts, params.n_samples, params.seq_len)
    model = load_model(src, DTYPES[params.compute_dtype])
    check_model_finite(model)
    requested = params.group_size
    params = dataclasses.replace(params, group_size=resolve_group_size(model, arch, params))
    plan = plan_layers(
        model, arch, QuantSpec(params.bits, params.group_size, params.sym), params.format, params.on_bad_group
    )
    if not ctx.is_main:
        return {}
    ctx.log.info(
        "quantize.%s: %s, %d-bit, group %d, %s",
        method,
        src,
        params.bits,
        params.group_size,
        "sym" if params.sym else "asym",
    )
    before = evaluate(model, tokenizer, eval_texts, params, "unquantized", device)
    start = time.perf_counter()
    quantized, info = quantize_model(model, arch, method, params, calib_ids, device, plan)
    wall = time.perf_counter() - start
    extra = _format_extra(method, params)
    qconfig = quantization_config(
        params.format, params.bits, params.group_size, params.sym, sorted(plan.skipped), extra
    )
    export(model, quantized, src, ctx.out_dir, qconfig, save_dtype(params.save_dtype, src), params.embedding_bits)
    del model
    from quantize.dequant import load_dequantized

    after = evaluate(
        load_dequantized(ctx.out_dir, DTYPES[params.compute_dtype]), tokenizer, eval_texts, params, method, device
    )
    increase = _relative(after, before)
    metrics: dict[str, Any] = {
        "method": method,
        "format": params.format,
        "group_size": params.group_size,
        "group_size_requested": requested,
        "save_dtype": str(save_dtype(params.save_dtype, src)).removeprefix("torch."),
        "embedding_bits": params.embedding_bits,
        "unquantized": _dicts(before),
        "quantized": _dicts(after),
        "perplexity_increase_rel": {lang: v["rel"] for lang, v in increase.items()},
        "perplexity_increase_se": {lang: v["se"] for lang, v in increase.items()},
        "quantize_seconds": wall,
        "size_bytes": dir_bytes(ctx.out_dir),
        "input_size_bytes": dir_bytes(src),
        "quantized_linears": len(quantized),
        "unquantized_linears": plan.skipped,
        "calibration_tokens": None if calib_ids is None else int(calib_ids.numel()),
    }
    metrics["compression"] = metrics["input_size_bytes"] / max(metrics["size_bytes"], 1)
    if "alphas" in info:
        metrics["awq_alpha_mean"] = sum(info["alphas"].values()) / max(len(info["alphas"]), 1)
    if method != "rtn" and params.compare_rtn:
        rtn = _rtn_reference(src, arch, params, plan, device, tokenizer, eval_texts)
        rtn_increase = _relative(rtn, before)
        metrics["rtn"] = _dicts(rtn)
        metrics["rtn_perplexity_increase_rel"] = {lang: v["rel"] for lang, v in rtn_increase.items()}
        metrics["rtn_perplexity_increase_se"] = {lang: v["se"] for lang, v in rtn_increase.items()}
        metrics["vs_rtn"] = _relative(after, rtn)  # paired: ppl(method) / ppl(RTN) - 1
    _log_summary(ctx, method, metrics)
    return metrics


def _format_extra(method: str, params: Any) -> dict[str, Any]:
    if method == "gptq":
        return {
            "desc_act": params.desc_act,
            "static_groups": params.static_groups,
            "damp_percent": params.damp,
            "true_sequential": True,
        }
    return {"desc_act": False}


def _rtn_reference(
    src: Path, arch: ArchSpec, params: Any, plan: Plan, device: str, tokenizer: Any, texts: dict[str, list[str]]
) -> dict[str, DocScores]:
    """RTN with the same grid (and embedding rounding) on a fresh copy of the input (cheap: no
    calibration)."""
    model = load_model(src, DTYPES[params.compute_dtype])
    quantize_model(model, arch, "rtn", params, None, device, plan)
    if params.embedding_bits == 8:
        fake_quantize_embeddings(model)
    return evaluate(model, tokenizer, texts, params, "rtn", device)


def _log_summary(ctx: Any, method: str, m: dict[str, Any]) -> None:
    for lang, rel in m["perplexity_increase_rel"].items():
        line = (
            f"quantize.{method} [{lang}] perplexity {m['unquantized'][lang]['perplexity']:.3f} ->"
            f" {m['quantized'][lang]['perplexity']:.3f} ({rel:+.2%} +- {m['perplexity_increase_se'][lang]:.2%})"
        )
        if "rtn" in m:
            line += (
                f"; RTN {m['rtn'][lang]['perplexity']:.3f} ({m['rtn_perplexity_increase_rel'][lang]:+.2%});"
                f" vs RTN {m['vs_rtn'][lang]['rel']:+.2%} +- {m['vs_rtn'][lang]['se']:.2%}"
            )
        ctx.log.info(line)
    ctx.log.info(
        "quantize.%s: %.1f s, %.2f MB on disk (%.2fx smaller)",
        method,
        m["quantize_seconds"],
        m["size_bytes"] / 1e6,
        m["compression"],
    )
