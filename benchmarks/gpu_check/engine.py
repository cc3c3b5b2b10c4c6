"""Part `engine`: the serving engine against transformers `generate`, greedy, per family and dtype.

Each run switches on prefix caching, chunked prefill, preemption and speculative decoding with
a same-family layer-skip draft (`warsha.engine_check`), and checks each path was taken; on CUDA
the decode forwards replay CUDA graphs (`serve.decode_graphs`), and one run per tiny family
without the draft puts the target's decode batches through them. GPTQ
int4 checkpoints go through `Int4TritonLinear` and are compared with transformers on exactly
their dequantized weights. On CUDA: the Mistral, Gemma 3 and Qwen 3 tiny shapes and the
TinyLlama-1.1B shape, float32 and bf16, int4 for the tiny shapes. On CPU: the Triton backend
under the interpreter, tiny shapes in float32 (bf16 and the 1.1B shape are skipped: hours
under the interpreter).

A divergence counts as a near-tie flip, not a failure, only between the reference's own two
best tokens with a logit gap under the dtype's tolerance: 1e-3 in float32 (summation order),
0.0625 in bf16 (a few bf16 steps at logits of magnitude 1-8, where kernels that round at
different points legitimately disagree).
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path
from typing import Any

from benchmarks.gpu_check.common import PartResult, part_main

TIE_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.0625}


def _workloads() -> dict[str, Any]:
    from warsha.engine_check import Workload

    tiny = Workload()
    big = Workload(shared_prefix=64, suffix=16, max_tokens=32, block_size=16, max_num_batched_tokens=64)
    return {"tiny": tiny, "tinyllama": big}


def build(family: str, root: Path, device: str) -> tuple[Path, Path]:
    """(target, layer-skip draft) checkpoints of `family` under `root` (built once)."""
    import torch

    from warsha.random_models import FAMILY_CONFIGS, make_layer_skip_draft, make_model, make_tinyllama

    target, draft = root / family / "target", root / family / "draft"
    if not (target / "config.json").is_file():
        if family == "tinyllama":
            make_tinyllama(target, torch.float32, device)
        else:
            make_model(target, seed=7, **FAMILY_CONFIGS[family])
    if not (draft / "config.json").is_file():
        make_layer_skip_draft(target, draft, num_layers=2 if family == "tinyllama" else 1)
    return target, draft


def check_engine(
    result: PartResult,
    name: str,
    target: Path,
    draft: Path | None,
    ref_dir: Path,
    dtype: str,
    device: str,
    workload: Any,
) -> None:
    """One engine run against transformers on `ref_dir` (the same model, or its dequantized twin).

    On CUDA, CUDA graphs replay the decode forwards (the draft's; without a draft, the target's):
    a run that replayed none fails."""
    import torch

    from warsha.engine_check import compare, hf_greedy, run_engine
    from warsha.random_models import hf_model

    run = run_engine(target, draft, workload, device=device, dtype=dtype, attention_backend="triton")
    ref = hf_model(ref_dir, getattr(torch, dtype), device)
    want = hf_greedy(ref, run["prompts"], workload.max_tokens)
    verdict = compare(run["tokens"], want, run["prompts"], ref, TIE_TOLERANCE[dtype])
    paths = {k: run[k] for k in ("prefix_hit_tokens", "preemptions", "drafted", "accepted", "graph_replays")}
    taken = run["prefix_hit_tokens"] > 0 and run["preemptions"] > 0 and (draft is None or run["drafted"] > 0)
    graphed = device != "cuda" or run["graph_replays"] > 0  # on CUDA decode steps replay graphs by default
    result.add(name, not verdict["mismatches"] and taken and graphed, **verdict, **paths)
    del ref
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def run(result: PartResult, args: argparse.Namespace) -> None:
    import torch

    from warsha.random_models import gptq_pair

    cuda = result.device == "cuda"
    if not cuda:  # the interpreter runs tiny torch ops one by one: extra threads only wait
        torch.set_num_threads(1)
    families = ["mistral", "gemma3", "qwen3"] + (["tinyllama"] if cuda else [])
    if args.quick:
        families = ["mistral"]
    dtypes = ["float32", "bfloat16"] if cuda else ["float32"]
    if not cuda:
        result.skip("bfloat16 engine runs", "no CUDA; bf16 kernels are tested under the interpreter")
        result.skip("TinyLlama-1.1B shape", "no CUDA; a 1.1B model under the Triton interpreter takes hours")
    loads = _workloads()
    for family in families:
        target, draft = build(family, args.workdir, result.device)
        workload = loads["tinyllama" if family == "tinyllama" else "tiny"]
        for dtype in dtypes:
            check_engine(result, f"{family} {dtype} vs HF generate", target, draft, target, dtype, result.device,
                         workload)  # fmt: skip
        if cuda and family != "tinyllama":  # no draft: the target's own decode batches replay from CUDA graphs
            check_engine(result, f"{family} float32 without a draft (target decode graphs) vs HF generate", target,
                         None, target, "float32", result.device, workload)  # fmt: skip
        if family == "tinyllama" or (args.quick and not cuda):
            continue
        qdir, ddir = gptq_pair(target, args.workdir / family / "gptq")
        qdraft = build_int4_draft(qdir)
        for dtype in dtypes:
            check_engine(result, f"{family} int4 GPTQ {dtype} vs HF on its dequantized weights", qdir, qdraft, ddir,
                         dtype, result.device, loads["tiny"])  # fmt: skip
    if not cuda and not args.quick:
        result.skip("int4 beyond float32", "no CUDA")


def build_int4_draft(qdir: Path) -> Path:
    """A one-layer int4 draft cut from the int4 checkpoint itself."""
    from warsha.random_models import make_layer_skip_draft

    draft = qdir.parent / "qdraft"
    return draft if (draft / "config.json").is_file() else make_layer_skip_draft(qdir, draft, num_layers=1)


if __name__ == "__main__":
    part_main("engine", run)
