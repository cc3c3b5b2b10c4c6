"""Warsha RTN / AWQ / GPTQ side by side (and llm-compressor's GPTQ/AWQ when available).

Same model, same calibration rows, same held-out validation text, same metric
(``warsha.evaluate.likelihood``): perplexity and bits per character per language, the relative
perplexity increase over the unquantized model, wall time of the quantization itself.

Run on CPU (trains a small Llama-architecture model on the bundled corpus first if no model is
given, about 10-20 minutes on 2 cores; the model is cached under benchmarks/results/):

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/quant_bench.py
    .venv/bin/python benchmarks/quant_bench.py --model runs/.../model --group-size 128 --bits 4

Peers: if ``/work/quantpeer-venv/bin/python`` exists (a separate venv with ``torch==2.13.0``
then ``llmcompressor==0.14.0.1``, which pins transformers 5.17), this script reruns itself there
as a worker on the same calibration ids and texts (``--peer-worker``). Writes
``benchmarks/results/quant_bench.json`` and prints a table. Never run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
PEER_PYTHON = Path("/work/quantpeer-venv/bin/python")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="HF model directory (default: train a small one)")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--n-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eval-documents", type=int, default=200)
    p.add_argument("--eval-max-length", type=int, default=256)
    p.add_argument("--methods", default="rtn,awq,gptq")
    p.add_argument("--train-steps", type=int, default=400)
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="1 is fastest on a busy 2-core machine")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS / "quant_bench.json")
    p.add_argument("--peer-worker", type=Path, help=argparse.SUPPRESS)
    return p.parse_args()


def train_default_model(out: Path, steps: int, batch: int, corpus: Any) -> Path:
    """A 4-layer Llama (hidden 256, MHA) on the Llama-type 32k tokenizer, bf16 on CPU."""
    import importlib.resources
    import shutil

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    sp = importlib.resources.files("mistral_common").joinpath("data", "tokenizer.model.v1")
    shutil.copy(str(sp), out / "tokenizer.model")
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    tok = AutoTokenizer.from_pretrained(out)
    tok.save_pretrained(out)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=len(tok), max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    from quantize.calib import calibration_ids, interleave

    texts = interleave([corpus.texts("ar", "train"), corpus.texts("en", "train")], seed=1)
    seq = 128
    data = calibration_ids(tok, texts, steps * batch // 4, seq)  # each row is seen about 4 times
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.05)
    from tqdm.auto import tqdm

    model.train()
    for step in (bar := tqdm(range(steps), desc="train bench model")):
        rows = torch.randint(0, data.shape[0], (batch,))
        ids = data[rows]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), sched.step(), opt.zero_grad()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval().save_pretrained(out)
    return out


def warsha_method(method: str, args: argparse.Namespace, model_dir: Path, calib: Any, texts: dict, tok: Any) -> dict[str, Any]:
    """Quantize with Warsha, export, load back through the dequant reference, evaluate."""
    from quantize.arch import arch_for
    from quantize.dequant import load_dequantized
    from quantize.export import export, quantization_config
    from quantize.layerwise import plan_layers
    from quantize.quantizer import QuantSpec
    from quantize.run import dir_bytes, evaluate, load_model, quantize_model
    from quantize.stages import AWQParams, GPTQParams, RTNParams

    common = {"bits": args.bits, "group_size": args.group_size, "eval_max_length": args.eval_max_length}
    params = {"rtn": RTNParams, "awq": AWQParams, "gptq": GPTQParams}[method](**common)
    if method != "rtn":
        params.n_samples, params.seq_len = args.n_samples, args.seq_len
    if args.bits != 4:
        params.format = "gptq"  # the AWQ GEMM layout holds 4-bit weights only
    model = load_model(model_dir, __import__("torch").float32)
    arch = arch_for(model.config.model_type)
    plan = plan_layers(model, arch, QuantSpec(params.bits, params.group_size, params.sym), params.format, "error")
    start = time.perf_counter()
    quantized, _ = quantize_model(model, arch, method, params, calib, "cpu", plan)
    wall = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        export(model, quantized, model_dir, Path(tmp), quantization_config(params.format, params.bits, params.group_size, params.sym, [], {}))
        size = dir_bytes(Path(tmp))
        scores = evaluate(load_dequantized(tmp), tok, texts, params, method)
    return {"scores": scores, "seconds": wall, "size_bytes": size, "format": params.format, "sym": params.sym}


def run_peers(args: argparse.Namespace, model_dir: Path, calib: Any, texts: dict) -> dict[str, Any]:
    """llm-compressor in its own venv, on the same rows and texts."""
    import torch

    if args.no_peers or not PEER_PYTHON.is_file():
        print(f"peers skipped ({'--no-peers' if args.no_peers else f'{PEER_PYTHON} not found'})")
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.pt"
        torch.save({"model": str(model_dir), "calib": calib, "texts": texts, "bits": args.bits,
                    "group_size": args.group_size, "eval_max_length": args.eval_max_length}, job)
        res = subprocess.run([str(PEER_PYTHON), __file__, "--peer-worker", str(job)], text=True,
                             capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if res.returncode != 0:
            print("peer worker failed:\n" + res.stderr[-3000:])
            return {"error": res.stderr[-1500:]}
        return json.loads((Path(tmp) / "job.json").read_text())


def peer_worker(job_path: Path) -> None:
    """Runs inside the peer venv: llm-compressor GPTQ and AWQ, scored with warsha.evaluate."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from warsha.evaluate import likelihood

    job = torch.load(job_path)
    tok = AutoTokenizer.from_pretrained(job["model"])
    rows = job["calib"]
    data = Dataset.from_dict({"input_ids": rows.tolist(), "attention_mask": torch.ones_like(rows).tolist()})
    scheme = {"gptq": "W4A16", "awq": "W4A16_ASYM"}
    out: dict[str, Any] = {}
    for name, modifier in (("llmcompressor-gptq", GPTQModifier), ("llmcompressor-awq", AWQModifier)):
        model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
        recipe = modifier(targets=["Linear"], scheme=scheme[name.split("-")[1]], ignore=["lm_head"])
        start = time.perf_counter()
        try:
            oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=rows.shape[0],
                    max_seq_length=rows.shape[1])
        except Exception as exc:  # a peer failing on CPU is a result to report, not a crash
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            continue
        wall = time.perf_counter() - start
        w = model.model.layers[0].self_attn.q_proj.weight.detach()
        groups = w.reshape(w.shape[0], -1, job["group_size"])
        levels = max(len(torch.unique(groups[r, g])) for r in range(4) for g in range(groups.shape[1]))
        scores = {}
        for lang, docs in job["texts"].items():
            lk = likelihood(model, tok, docs, job["eval_max_length"], 8)
            scores[lang] = {"perplexity": lk.perplexity, "bits_per_char": lk.bits_per_char, "tokens": lk.tokens}
        out[name] = {"scores": scores, "seconds": wall, "size_bytes": None, "format": "compressed-tensors (in memory)",
                     "max_levels_per_group": levels}  # <= 2**bits proves the weights were quantized
    (job_path.with_suffix(".json")).write_text(json.dumps(out))


def table(results: dict[str, Any]) -> str:
    base = results["unquantized"]["scores"]
    langs = list(base)
    head = ["method"] + [f"ppl {l}" for l in langs] + [f"+ppl {l}" for l in langs] + [f"bpc {l}" for l in langs] + ["seconds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        if "scores" not in r:
            lines.append(f"| {name} | failed: {r.get('error', '?')[:80]} |")
            continue
        s = r["scores"]
        cells = [name] + [f"{s[l]['perplexity']:.3f}" for l in langs]
        cells += [f"{s[l]['perplexity'] / base[l]['perplexity'] - 1:+.2%}" for l in langs]
        cells += [f"{s[l]['bits_per_char']:.4f}" for l in langs] + [f"{r.get('seconds', 0):.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.peer_worker:
        peer_worker(args.peer_worker)
        return
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from quantize.calib import calibration_ids, interleave
    from quantize.run import evaluate, load_model
    from quantize.stages import RTNParams
    from warsha.data import DataConfig, load_corpus

    corpus = load_corpus(DataConfig())
    model_dir = args.model or train_default_model(RESULTS / "quant_bench_model", args.train_steps, args.train_batch, corpus)
    tok = AutoTokenizer.from_pretrained(model_dir)
    calib = calibration_ids(tok, interleave([corpus.texts("ar", "train"), corpus.texts("en", "train")], 0), args.n_samples, args.seq_len)
    texts = {lang: corpus.texts(lang, "validation")[: args.eval_documents] for lang in ("ar", "en")}
    eval_params = RTNParams(eval_max_length=args.eval_max_length)
    results: dict[str, Any] = {"unquantized": {"scores": evaluate(load_model(model_dir, torch.float32), tok, texts, eval_params, "fp32")}}
    for method in args.methods.split(","):
        results[f"warsha-{method}"] = warsha_method(method, args, model_dir, calib, texts, tok)
        print(f"{method}: {results[f'warsha-{method}']['seconds']:.1f} s")
    results.update(run_peers(args, model_dir, calib, texts))
    report = {"model": str(model_dir), "bits": args.bits, "group_size": args.group_size, "n_samples": args.n_samples,
              "seq_len": args.seq_len, "eval_documents": args.eval_documents, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(table(results))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
