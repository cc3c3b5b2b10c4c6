"""Scenario g of serve_bench: the real Gemma 3 270M (from the `real` extra's GGUF) served by Warsha
vs HF `generate`, batch-1 decode and the mixed workload, Warsha and HF each in float32 and bf16.

float32 is HF's best setting on a CPU without native bf16; bf16 is reported beside it. The HF
directory is converted once from the GGUF (the tests' fixture helper, cached under
~/.cache/warsha-tests/) and reused.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

VOCAB = 262144


def real_gemma_dir() -> tuple[Path | None, str | None]:
    """The converted model directory, or None and why it is not available."""
    from tests.serve.real_gemma import cached_dir, missing_reason

    reason = missing_reason()
    return (None, reason) if reason else (cached_dir(), None)


def scenario_g(args: argparse.Namespace, helpers: dict[str, Callable[..., Any]]) -> dict[str, Any]:
    """Batch-1 decode and the mixed workload on Gemma 3 270M; `helpers` are serve_bench's runners."""
    path, reason = real_gemma_dir()
    if path is None:
        print(f"scenario g skipped: {reason}")
        return {"skipped": reason}
    workload, run_warsha, run_hf_static = helpers["workload"], helpers["run_warsha"], helpers["run_hf_static"]
    decode_rate, hf_decode_rate, hf_load = helpers["decode_rate"], helpers["hf_decode_rate"], helpers["hf_load"]
    identical = helpers["identical"]
    res: dict[str, Any] = {"model_dir": str(path)}
    n_dec = 32 if args.quick else 128
    prompt = [2] + workload(1, (127, 127), (1, 1), VOCAB, seed=2)[0][0]
    hf = {"float32": hf_load(path, torch.float32), "bfloat16": hf_load(path, torch.bfloat16)}
    for dtype in ("float32", "bfloat16"):
        res[f"b1_warsha_{dtype}_tok_s"] = decode_rate(path, prompt, n_dec, dtype=dtype)
        res[f"b1_hf_{dtype}_tok_s"] = hf_decode_rate(hf[dtype], prompt, n_dec)
    n, out_hi = (16, 64) if args.quick else (64, 256)
    n = args.real_requests or n
    reqs = [([2] + p, m) for p, m in workload(n, (16, 512), (16, out_hi), VOCAB, seed=0)]
    res["mixed_requests"] = n
    for dtype in ("float32", "bfloat16"):
        res[f"mixed_warsha_{dtype}"] = run_warsha(path, reqs, dtype=dtype)
        res[f"mixed_hf_{dtype}"] = run_hf_static(hf[dtype], reqs)
    res["mixed_identical_warsha_vs_hf_float32"] = identical(
        res["mixed_warsha_float32"]["outputs"], res["mixed_hf_float32"]["outputs"]
    )
    return res


def print_g(g: dict[str, Any]) -> None:
    """The scenario's table."""
    if "skipped" in g:
        print(f"\n(g) Gemma 3 270M: skipped ({g['skipped']})")
        return
    print("\n(g) Gemma 3 270M (real weights), tokens/s")
    print(f"{'':28s}{'warsha fp32':>14s}{'hf fp32':>10s}{'warsha bf16':>14s}{'hf bf16':>10s}")
    b1 = [g[f"b1_{e}_{d}_tok_s"] for d in ("float32", "bfloat16") for e in ("warsha", "hf")]
    print(f"{'batch-1 decode':28s}" + "".join(f"{x:>{w}.1f}" for x, w in zip(b1, (14, 10, 14, 10))))
    mixed = [g[f"mixed_{e}_{d}"]["tok_per_s"] for d in ("float32", "bfloat16") for e in ("warsha", "hf")]
    label = f"mixed {g['mixed_requests']} requests"
    print(f"{label:28s}" + "".join(f"{x:>{w}.1f}" for x, w in zip(mixed, (14, 10, 14, 10))))
    print(f"greedy outputs identical to HF fp32 (mixed): {g['mixed_identical_warsha_vs_hf_float32']:.0%}")
