"""Which engines load each of a recipe's exports, and whether they generate what serve generates.

A checkpoint that only Warsha reads proves nothing about its format. For every export of a run
directory (the float artifacts such as `yarn`, with its `rope_scaling`, and the GPTQ/AWQ
checkpoints) this loads the export in:

- serve (Warsha's engine), the reference;
- vLLM's CPU backend (its own venv, `bash benchmarks/peers/setup_vllm_cpu.sh`) in `--dtype`
  (bf16 by default: vLLM refuses float32 for GPTQ), against serve in the same dtype;
- transformers in float32, against serve in float32: `from_pretrained` for float artifacts; a
  quantized export through
  `quantize.dequant.load_dequantized` (Warsha's reader of the packed tensors into a plain
  transformers model: transformers' own GPTQ/AWQ loaders need GPTQModel or AutoAWQ and a GPU);

and compares greedy continuations of the same token-id prompts (Arabic and English documents
from `warsha.domains`, encoded by the export's tokenizer) with serve's, classifying each
divergence as `serve.validate` does: a near-tie flip (serve's two best tokens less than
`--tie-tolerance` nats apart) or a real mismatch. The `quantize.gguf` stage's manifest supplies
llama.cpp's rows (it runs llama.cpp on the GGUF files and compares the F16 file with serve).

    .venv/bin/python -m benchmarks.interop runs/arabic-tiny --exports yarn,gptq,awq --gguf gguf

Prints one table and writes benchmarks/results/interop-<time>.json. Not run in CI (the peers
need their venvs); the method and the current table are in docs/export.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import serve_bench as sb
from benchmarks.serve_peers import PEERS_CACHE, run_vllm
from warsha import domains


def prompts_for(export: Path, n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` ids (BOS first): alternately Arabic and English other-domain text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export)
    texts = [t for pair in zip(domains.load("ar_msa", n), domains.load("en_essays", n)) for t in pair][:n]
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    return [bos + tok(t, add_special_tokens=False)["input_ids"][: length - len(bos)] for t in texts]


def is_quantized(export: Path) -> bool:
    """Whether `export`'s config.json carries a quantization_config (GPTQ/AWQ)."""
    return "quantization_config" in json.loads((export / "config.json").read_text())


def transformers_greedy(export: Path, prompts: list[list[int]], n: int, dtype: torch.dtype) -> list[list[int]]:
    """Greedy continuations from a transformers model of `export` (EOS ignored: `n` tokens each)."""
    from transformers import AutoModelForCausalLM

    if is_quantized(export):
        from quantize.dequant import load_dequantized

        model = load_dequantized(export, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(export, dtype=dtype)
    model.eval()
    model.generation_config.max_length = None  # a long-context config's max_length beside max_new_tokens warns per call
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None)
            outs.append(gen[0, len(p) :].tolist())
    return outs


def compare(engine: Any, prompts: list[list[int]], ref: list[list[int]], other: list[list[int]], tol: float) -> dict:
    """serve.validate's comparison: identical requests, near-tie flips, real mismatches."""
    from warsha.serve_validate import compare_outputs

    c = compare_outputs(engine, prompts, ref, other, tol)
    real = c["mismatched_requests"] - c["near_tie_flips"]
    return {"identical": len(prompts) - c["mismatched_requests"], "real_mismatches": real, **c}


def serve_greedy(export: Path, prompts: list[list[int]], n: int, dtype: str) -> tuple[Any, list[list[int]]]:
    """serve's engine on `export` in `dtype` and its greedy continuations (EOS ignored). int4 layers
    take float activations: serve's int8-activation path is its own approximation, not the format's."""
    from serve import LLM, SamplingParams

    llm = LLM(export, dtype=dtype, kv_cache_memory_gb=1.0, int4_activations="float")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return llm, [o.token_ids for o in outs]


def failed(row: dict[str, Any], exc: Exception | str) -> dict[str, Any]:
    """A row for an engine that did not load the export (a row of the table, not the end of the run)."""
    return {**row, "loads": False, "error": exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"}


def compared(
    row: dict[str, Any], serve: tuple[Any, list[list[int]]] | None, prompts: list, outs: list, tol: float
) -> dict:
    """A loaded engine's row: its outputs against serve's, or only "loads" when serve could not load it."""
    if serve is None:
        return {**row, "loads": True, "note": "serve does not load this export: outputs not compared"}
    return {**row, "loads": True, **compare(serve[0], prompts, serve[1], outs, tol)}


def try_serve(export: Path, prompts: list[list[int]], n: int, dtype: str, rows: list, name: str) -> Any:
    """serve's engine and outputs in `dtype`, or None with a failed row (an export serve cannot load)."""
    try:
        return serve_greedy(export, prompts, n, dtype)
    except Exception as exc:  # noqa: BLE001 - the table reports it
        rows.append(failed({"export": name, "engine": "serve", "dtype": dtype}, exc))
        return None


def one_export(name: str, export: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """serve, vLLM (in `--dtype`) and transformers (float32, against serve float32) on one export."""
    prompts = prompts_for(export, args.prompts, args.prompt_tokens)
    rows: list[dict[str, Any]] = []
    serve = try_serve(export, prompts, args.max_tokens, args.dtype, rows, name)
    if serve is not None:
        rows.append({"export": name, "engine": "serve", "dtype": args.dtype, "loads": True, "identical": len(prompts)})
    if "vllm" not in args.skip:
        requests = [[p, args.max_tokens] for p in prompts]
        res = run_vllm(export, args.dtype, [{"name": "greedy", "requests": requests}], args)
        row = {"export": name, "engine": f"vLLM CPU {res.get('vllm', '')}".strip(), "dtype": args.dtype}
        if "error" in res:
            rows.append(failed(row, res["error"][-600:]))
        else:
            rows.append(compared(row, serve, prompts, res["jobs"]["greedy"]["outputs"], args.tol))
    if "transformers" not in args.skip:
        del serve
        serve = try_serve(export, prompts, args.max_tokens, "float32", [], name)
        row = {"export": name, "engine": "transformers" + (" (dequantized)" if is_quantized(export) else "")}
        row["dtype"] = "float32"
        try:
            outs = transformers_greedy(export, prompts, args.max_tokens, torch.float32)
            rows.append(compared(row, serve, prompts, outs, args.tol))
        except Exception as exc:  # noqa: BLE001 - the table reports it
            rows.append(failed(row, exc))
    return rows


def gguf_rows(stage_dir: Path) -> list[dict[str, Any]]:
    """llama.cpp's rows, as the `quantize.gguf` stage measured them (F16 against serve float32)."""
    m = json.loads((stage_dir / "warsha.json").read_text())["metrics"]
    g = m["greedy_f16_vs_serve_float32"]
    n = g["prompts"]
    differing = sum(v["differing"] for v in m["tokenization"].values())
    rows = [
        {
            "export": f"gguf F16 ({stage_dir.name})",
            "engine": "llama.cpp",
            "dtype": "F16",
            "loads": True,
            "identical": n - g["mismatched_requests"],
            "near_tie_flips": g["near_tie_flips"],
            "real_mismatches": g["mismatched_requests"] - g["near_tie_flips"],
            "tokenization_differing": differing,
        }
    ]
    for t, r in m["types"].items():
        if t != "F16":
            rows.append(
                {
                    "export": f"gguf {t}",
                    "engine": "llama.cpp",
                    "dtype": t,
                    "loads": True,
                    "size_mib": r["size_bytes"] / 2**20,
                }
            )
    return rows


def print_table(rows: list[dict[str, Any]], n: int) -> None:
    """One line per export and engine."""
    print(f"| export | engine | dtype | loads | identical of {n} | near-tie flips | real mismatches |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [r.get(k, "") for k in ("identical", "near_tie_flips", "real_mismatches")]
        if not r["loads"]:
            lines = [line.strip() for line in r["error"].splitlines() if line.strip()]
            cells = ["error: " + next((x for x in lines if "Value error" in x), lines[-1])[:120], "", ""]
        elif "note" in r:
            cells = [r["note"], "", ""]
        print(
            f"| {r['export']} | {r['engine']} | {r['dtype']} | {'yes' if r['loads'] else 'no'} | "
            + " | ".join(str(c) for c in cells)
            + " |"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path, help="a recipe's run directory, e.g. runs/arabic-tiny")
    p.add_argument("--exports", default="yarn,gptq,awq", help="stage ids of the exports to load (comma list)")
    p.add_argument("--gguf", default="gguf", help="the quantize.gguf stage id ('' to leave out)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="vLLM refuses float32 for GPTQ")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--tol", type=float, default=0.05, help="near-tie tolerance in nats (serve.validate's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--skip", default="", help="engines to leave out: vllm,transformers")
    p.add_argument("--peers-cache", type=Path, default=PEERS_CACHE, help="where the set-up scripts put the venvs")
    args = p.parse_args(argv)
    args.skip = set(filter(None, args.skip.split(",")))
    exports = {e: args.run_dir / e for e in filter(None, args.exports.split(","))}
    missing = [str(d) for d in exports.values() if not (d / "config.json").is_file()]
    if missing:
        p.error(f"--exports: no config.json in {', '.join(missing)}; name stage ids of {args.run_dir}")
    torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    for name, d in exports.items():
        rows += one_export(name, d, args)
    if args.gguf and (args.run_dir / args.gguf / "warsha.json").is_file():
        rows += gguf_rows(args.run_dir / args.gguf)
    print_table(rows, args.prompts)
    sb.RESULTS.mkdir(exist_ok=True)
    out = sb.RESULTS / f"interop-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(
        json.dumps(
            {"run_dir": str(args.run_dir), "args": {**vars(args), "skip": sorted(args.skip)}, "rows": rows},
            indent=2,
            default=str,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
