"""Warsha RTN / AWQ / GPTQ against llm-compressor's GPTQ / AWQ, side by side.

Same model, same calibration rows (packed by ``quantize.calib`` from the corpus's train split,
languages mixed as ``--calib-langs`` says), same held-out validation documents, same evaluator
(``warsha.evaluate.document_nll``, ``warsha.evaluate.likelihood`` split by document):
perplexity per language, its relative increase over the unquantized model with a paired
standard error over documents, each method against RTN and against its llm-compressor
counterpart (also paired), and the wall time of the quantization itself.

llm-compressor runs in its own venv (it pins transformers 5.17): ``benchmarks/peers/
make_venv.sh`` creates ``/work/venvs/peers``; this script sends it the calibration rows, it
writes each quantized model as plain float weights, and they are scored here. With
``--peer-load`` the Warsha GPTQ and AWQ exports are also loaded by GPTQModel in that venv
(``python -m benchmarks.peers.gptqmodel_load``) and its logits compared with Warsha's reference.

CPU, about 25-40 minutes on a shared 2-core machine (each evaluation of 2 x 300 documents on the
19M-parameter demo model takes 3-5 minutes; quantization itself is seconds to minutes):

    .venv/bin/python -m benchmarks.quant_bench --model runs/arabic-tiny/yarn --group-size 128
    .venv/bin/python -m benchmarks.quant_bench --model runs/arabic-tiny/yarn --group-size 64 --no-peers

``--methods rtn,rtn-asym,awq,awq-noclip,gptq`` adds RTN on AWQ's asymmetric grid, the
like-for-like baseline of both AWQs (column ``vs RTN-asym``; ``rtn`` is Warsha's default,
symmetric), and Warsha's AWQ without its clipping search (llm-compressor's AWQ has none).

The tiny models trained here lose about 0.05% perplexity to 4-bit RTN, inside evaluation noise,
so methods cannot be ranked on them. ``benchmarks/outlier_standin.py`` writes a copy of a model
that computes the same function but carries x10 weight outliers in 4 channels per layer, where
RTN costs what it costs real LLMs (+3% in English); the README reports both.

A linear the group size does not divide (the demo's down_proj has 704 inputs: 128 does not
divide it) stays in float for every method, Warsha's and the peer's alike. Writes
``benchmarks/results/quant_bench-g<group>.json`` and prints a table. Never run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PEER_PYTHON = Path(os.environ.get("WARSHA_PEER_PYTHON", "/work/venvs/peers/bin/python"))
PEERS = ROOT / "benchmarks" / "peers"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "runs" / "arabic-tiny" / "yarn", help="HF model directory")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--n-samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--calib-langs", default="ar,en", help="calibration languages, interleaved by document")
    p.add_argument("--eval-documents", type=int, default=300, help="validation documents per language")
    p.add_argument("--eval-max-length", type=int, default=256)
    p.add_argument(
        "--methods",
        default="rtn,awq,gptq",
        help="comma list of rtn, rtn-asym (RTN on AWQ's asymmetric grid: AWQ's like-for-like baseline), awq, gptq",
    )
    p.add_argument(
        "--gptq-act-order",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="act-order with static groups (llm-compressor's default 'static')",
    )
    p.add_argument("--threads", type=int, default=1, help="1 is fastest on a busy 2-core machine")
    p.add_argument("--no-peers", action="store_true", help="skip llm-compressor")
    p.add_argument("--peer-methods", default="gptq,awq", help="llm-compressor methods to run (comma list)")
    p.add_argument("--peer-load", action="store_true", help="also load Warsha's exports with GPTQModel")
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--pair",
        nargs="+",
        metavar="FILE:NAME",
        help="compare a result of an earlier run with another over their documents (paired) and exit;"
        " more than one after the first are averaged per document (a non-deterministic peer's runs),"
        " e.g. --pair a.json:warsha-gptq b.json:llmcompressor-gptq c.json:llmcompressor-gptq",
    )
    return p.parse_args()


def warsha_params(method: str, args: argparse.Namespace) -> Any:
    """The stage's own parameter dataclass, so the bench runs exactly what a recipe would."""
    from quantize.stages import AWQParams, GPTQParams, RTNParams

    common = {
        "bits": args.bits,
        "group_size": args.group_size,
        "on_bad_group": "fallback",
        "eval_max_length": args.eval_max_length,
    }
    if method == "rtn":
        return RTNParams(**common)
    if method == "rtn-asym":
        return RTNParams(**common, sym=False, format="awq" if args.bits == 4 else "gptq")
    calib = {"n_samples": args.n_samples, "seq_len": args.seq_len, "calib_langs": args.calib_langs.split(",")}
    if method.startswith("awq"):  # awq-noclip: the scale search alone, as llm-compressor's AWQ does
        return AWQParams(**common, **calib, format="awq" if args.bits == 4 else "gptq", clip=method != "awq-noclip")
    return GPTQParams(**common, **calib, desc_act=args.gptq_act_order, static_groups=True)


def warsha_method(
    method: str, args: argparse.Namespace, calib: Any, texts: dict, tok: Any, keep: Path
) -> tuple[dict, dict]:
    """Quantize, export, load back through the dequant reference, score per document."""
    import torch

    from quantize.arch import arch_for
    from quantize.dequant import load_dequantized
    from quantize.export import export, quantization_config
    from quantize.layerwise import plan_layers
    from quantize.quantizer import QuantSpec
    from quantize.run import _format_extra, dir_bytes, load_model, quantize_model

    params = warsha_params(method, args)
    model = load_model(args.model, torch.float32)
    arch = arch_for(model.config.model_type)
    plan = plan_layers(model, arch, QuantSpec(params.bits, params.group_size, params.sym), params.format, "fallback")
    start = time.perf_counter()
    algo = "rtn" if method.startswith("rtn") else method.split("-")[0]
    quantized, _ = quantize_model(model, arch, algo, params, None if algo == "rtn" else calib, "cpu", plan)
    wall = time.perf_counter() - start
    qc = quantization_config(
        params.format, params.bits, params.group_size, params.sym, sorted(plan.skipped), _format_extra(algo, params)
    )
    export(model, quantized, args.model, keep, qc)
    scores = score(load_dequantized(keep), tok, texts, args)
    info = {
        "seconds": wall,
        "size_bytes": dir_bytes(keep),
        "format": params.format,
        "sym": params.sym,
        "unquantized_linears": sorted(plan.skipped),
        "export_dir": str(keep),
    }
    if method == "gptq":
        info["desc_act"] = params.desc_act
    return info, scores


def score(model: Any, tok: Any, texts: dict, args: argparse.Namespace) -> dict:
    from quantize.evalstats import DocScores
    from warsha.evaluate import document_nll

    return {
        lang: DocScores.of(docs, *document_nll(model, tok, docs, args.eval_max_length, 8))
        for lang, docs in texts.items()
    }


def run_llmcompressor(args: argparse.Namespace, calib: Any, ignore: list[str], tmp: Path) -> dict[str, Any]:
    """llm-compressor GPTQ and AWQ in the peer venv on the same rows; returns its result.json."""
    import torch

    job = tmp / "job.pt"
    torch.save(
        {
            "model": str(args.model.resolve()),
            "calib": calib,
            "bits": args.bits,
            "group_size": args.group_size,
            "methods": args.peer_methods.split(","),
            "ignore": ignore,
            "threads": args.threads,
            "gptq_actorder": "static" if args.gptq_act_order else None,
        },
        job,
    )
    res = subprocess.run(
        [str(PEER_PYTHON), str(PEERS / "llmcompressor_quant.py"), str(job), str(tmp / "lc")],
        text=True,
        capture_output=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if res.returncode != 0:
        return {"error": res.stderr[-1500:]}
    return json.loads((tmp / "lc" / "result.json").read_text())


def peer_load(export_dir: Path, method: str, group_size: int) -> dict[str, Any]:
    """GPTQModel loads a Warsha export; its JSON report (or the failure)."""
    out = RESULTS / f"peer_load-{method}-g{group_size}.json"
    res = subprocess.run(
        [str(PEER_PYTHON), "-m", "benchmarks.peers.gptqmodel_load", str(export_dir), "--out", str(out)],
        text=True,
        capture_output=True,
        env={**os.environ, "GPTQMODEL_CPU_WORKERS": "2"},
        cwd=ROOT,  # the peer venv reads quantize/ from this checkout
    )
    if not out.is_file():
        return {"error": res.stderr[-1500:]}
    return json.loads(out.read_text())


def compare(results: dict[str, Any], scores: dict[str, dict]) -> None:
    """Relative perplexity increases with paired standard errors, in place."""
    from quantize.evalstats import relative_increase

    base = scores["unquantized"]
    pairs = {"vs_rtn": "warsha-rtn"}
    for name, r in results.items():
        if name not in scores:
            continue
        r["scores"] = {lang: s.as_dict() for lang, s in scores[name].items()}
        r["documents"] = {lang: s.per_document() for lang, s in scores[name].items()}
        if name == "unquantized":
            continue
        r["increase"] = {lang: relative_increase(s, base[lang]) for lang, s in scores[name].items()}
        refs = dict(pairs)
        if name.startswith("warsha-awq") or name == "llmcompressor-awq":
            refs["vs_rtn_asym"] = "warsha-rtn-asym"  # the same asymmetric grid, no calibration
        peer = {
            "warsha-gptq": "llmcompressor-gptq",
            "warsha-awq": "llmcompressor-awq",
            "warsha-awq-noclip": "llmcompressor-awq",
        }.get(name)
        if peer:
            refs["vs_peer"] = peer
        for key, ref in refs.items():
            if ref in scores and ref != name:
                r[key] = {lang: relative_increase(s, scores[ref][lang]) for lang, s in scores[name].items()}
        if peer and "seconds" in results.get(peer, {}):
            r["seconds_vs_peer"] = r["seconds"] / results[peer]["seconds"]


def table(results: dict[str, Any]) -> str:
    langs = list(results["unquantized"]["scores"])
    keys = (
        ["increase", "vs_rtn"]
        + (["vs_rtn_asym"] if any("vs_rtn_asym" in r for r in results.values()) else [])
        + ["vs_peer"]
    )
    titles = {
        "increase": "+ppl {} (se)",
        "vs_rtn": "vs RTN {}",
        "vs_rtn_asym": "vs RTN-asym {}",
        "vs_peer": "vs peer {}",
    }
    head = ["method"] + [f"ppl {lang}" for lang in langs]
    head += [titles[k].format(lang) for k in keys for lang in langs] + ["seconds"]
    fmt = lambda v: f"{100 * v[0]:+.2f}% ({100 * v[1]:.2f})"  # noqa: E731
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        if name == "peer_environment":
            continue
        if "scores" not in r:
            lines.append(f"| {name} | failed: {str(r.get('error', '?'))[-120:]} |")
            continue
        cells = [name] + [f"{r['scores'][lang]['perplexity']:.3f}" for lang in langs]
        for key in keys:
            cells += [fmt(r[key][lang]) if key in r else "" for lang in langs]
        cells.append(f"{r['seconds']:.1f}" if "seconds" in r else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    from warsha import runtime

    runtime.apply(reexec=True)  # allocator and threads before the first tensor
    args = parse_args()
    if args.pair:
        from quantize.evalstats import pair

        for lang, (inc, se) in pair(*args.pair).items():
            over = " and ".join(args.pair[1:])
            print(f"{lang}: {100 * inc:+.2f}% (s.e. {100 * se:.2f}) {args.pair[0]} over {over}")
        return
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantize.calib import calibration_ids, interleave
    from quantize.run import load_model
    from warsha.data import DataConfig, load_corpus

    corpus = load_corpus(DataConfig(strip_diacritics=True, validation_fraction=0.02, test_fraction=0.02))
    tok = AutoTokenizer.from_pretrained(args.model)
    langs = args.calib_langs.split(",")
    texts = interleave([corpus.texts(lang, "train") for lang in langs], 0)
    calib = calibration_ids(tok, texts, args.n_samples, args.seq_len)
    texts = {lang: corpus.texts(lang, "validation")[: args.eval_documents] for lang in ("ar", "en")}
    results: dict[str, Any] = {"unquantized": {}}
    scores = {"unquantized": score(load_model(args.model, torch.float32), tok, texts, args)}
    with tempfile.TemporaryDirectory() as tmp_str:
        tmp = Path(tmp_str)
        for method in args.methods.split(","):
            info, scores[f"warsha-{method}"] = warsha_method(method, args, calib, texts, tok, tmp / method)
            results[f"warsha-{method}"] = info
            print(f"warsha-{method}: {info['seconds']:.1f} s", flush=True)
            if args.peer_load and method in ("gptq", "awq") and PEER_PYTHON.is_file():
                info["peer_load"] = peer_load(tmp / method, method, args.group_size)
        ignore = results.get("warsha-gptq", results.get("warsha-rtn", {})).get("unquantized_linears", [])
        if args.no_peers or not PEER_PYTHON.is_file():
            print(f"llm-compressor skipped ({'--no-peers' if args.no_peers else f'{PEER_PYTHON} not found'})")
        else:
            lc = run_llmcompressor(args, calib, ignore, tmp)
            results["peer_environment"] = {k: v for k, v in lc.items() if k not in ("gptq", "awq")}
            for method in args.peer_methods.split(","):
                r = lc.get(method, {"error": lc.get("error", "not run")})
                results[f"llmcompressor-{method}"] = r
                if "model_dir" in r:
                    model = AutoModelForCausalLM.from_pretrained(r.pop("model_dir"), dtype=torch.float32).eval()
                    scores[f"llmcompressor-{method}"] = score(model, tok, texts, args)
                    print(f"llmcompressor-{method}: {r['seconds']:.1f} s", flush=True)
    compare(results, scores)
    report = {
        "model": str(args.model),
        "bits": args.bits,
        "group_size": args.group_size,
        "n_samples": args.n_samples,
        "seq_len": args.seq_len,
        "calib_langs": langs,
        "eval_documents": args.eval_documents,
        "eval_max_length": args.eval_max_length,
        "threads": args.threads,
        "gptq_act_order": args.gptq_act_order,
        "increase_format": "[relative perplexity change, standard error over documents (paired)]",
        "results": results,
    }
    out = args.out or RESULTS / f"quant_bench-g{args.group_size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(table(results))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
