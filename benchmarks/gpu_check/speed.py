"""Part `speed` (CUDA only): the TinyLlama-1.1B shape in bf16, random weights.

- HBM roofline: a device-to-device copy of 1 GiB gives the bandwidth (bytes read plus written
  per second); a decode step must read every weight once except the embedding table (one row),
  so batch-1 decode cannot beat bandwidth / those bytes. KV reads are left out (short context).
- batch-1 decode: 256 generated tokens after a 32-token prompt, minus the prefill-only run, for
  the engine with CUDA graphs (the default), the engine eager (`cuda_graphs=False`, the server's
  `--enforce-eager`) and transformers `generate` (SDPA, bf16), each the best of two.
- 64 mixed requests (prompts 16-512 tokens, outputs 16-256, seeded): the engine with continuous
  batching; transformers `generate` on the 64 left-padded prompts at once (static batching: it
  runs to the longest output, only the requested tokens count); transformers' continuous
  batching (`generate_batch`) where this transformers has it.
Figures are reported, not judged: the one check is that every run produced its tokens.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.gpu_check.common import PartResult, part_main


def copy_bandwidth() -> float:
    """Device memory bandwidth in GB/s from timed 1 GiB device-to-device copies (read + write)."""
    import torch

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000
    del src, dst
    return 2 * 20 * 2**30 / seconds / 1e9


def step_bytes(model_dir: Path) -> int:
    """Bytes a batch-1 decode step reads: every tensor but the embedding table."""
    from safetensors import safe_open

    from serve.weights import checkpoint_files

    total = 0
    for path in checkpoint_files(model_dir):  # one file or the shards its index lists
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                if name != "model.embed_tokens.weight":
                    n = 1
                    for d in f.get_slice(name).get_shape():
                        n *= d
                    total += n * 2  # bf16
    return total


def timed(fn: Any) -> float:
    """Seconds of `fn()`, the GPU drained before and after."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def decode_rate(run: Callable[[int], float], n: int = 256) -> float:
    """Decode tokens/s from a runner of k-token generations: (n + 1 tokens) minus (1 token)."""
    run(8)  # warm-up: kernels compiled, allocator primed
    return round(n / min(run(n + 1) - run(1) for _ in range(2)), 1)


def engine_runner(llm: Any, prompt: list[int]) -> Callable[[int], float]:
    """Seconds of the engine generating k greedy tokens after `prompt`."""
    from serve import SamplingParams

    def run(k: int) -> float:
        return timed(lambda: llm.generate([prompt], SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)))

    return run


def hf_runner(hf: Any, prompt: list[int]) -> Callable[[int], float]:
    """Seconds of transformers `generate` making exactly k greedy tokens after `prompt`."""
    import torch

    ids = torch.tensor([prompt], device="cuda")
    return lambda k: timed(lambda: hf.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False))


def mixed_workload(seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """64 prompts of 16-512 tokens and their output lengths of 16-256."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(16, 513, (64,), generator=g).tolist()
    outs = torch.randint(16, 257, (64,), generator=g).tolist()
    return [[1] + torch.randint(3, 32000, (n - 1,), generator=g).tolist() for n in lens], outs


def engine_mixed(llm: Any, prompts: list[list[int]], outs: list[int]) -> dict[str, float]:
    from serve import SamplingParams

    params = [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in outs]
    results: list[Any] = []
    seconds = timed(lambda: results.extend(llm.generate(prompts, params)))
    made = sum(len(r.token_ids) for r in results)
    return {"seconds": round(seconds, 2), "tokens": made, "tok_s": round(made / seconds, 1)}


def hf_static(hf: Any, prompts: list[list[int]], outs: list[int]) -> dict[str, float]:
    """All 64 left-padded at once, run to the longest output; requested tokens counted."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.cuda(), mask.cuda()
    gen = lambda: hf.generate(ids, attention_mask=mask, max_new_tokens=max(outs), do_sample=False, pad_token_id=0)  # noqa: E731
    seconds = timed(gen)
    return {"seconds": round(seconds, 2), "tokens": sum(outs), "tok_s": round(sum(outs) / seconds, 1)}


def hf_continuous(hf: Any, prompts: list[list[int]], outs: list[int]) -> dict[str, Any]:
    """transformers' continuous batching, where `generate_batch` exists (one max_new_tokens for all)."""
    from transformers import GenerationConfig

    if not hasattr(hf, "generate_batch"):
        return {"skipped": "this transformers has no generate_batch"}
    config = GenerationConfig(max_new_tokens=max(outs), do_sample=False, eos_token_id=-1, pad_token_id=0)
    seconds = timed(lambda: hf.generate_batch(inputs=prompts, generation_config=config, progress_bar=False))
    tokens = len(prompts) * max(outs)
    return {"seconds": round(seconds, 2), "tokens": tokens, "tok_s": round(tokens / seconds, 1)}


def run(result: PartResult, args: argparse.Namespace) -> None:
    if result.device != "cuda":
        result.skip("TinyLlama-shape throughput and roofline", "no CUDA device")
        return
    import torch

    from serve import LLM
    from warsha.random_models import hf_model, make_tinyllama

    target = args.workdir / "tinyllama-bf16"
    if not (target / "config.json").is_file():
        make_tinyllama(target, torch.bfloat16, "cuda")
    bandwidth = copy_bandwidth()
    nbytes = step_bytes(target)
    roofline = {"copy_bandwidth_gb_s": round(bandwidth, 1), "bytes_per_step": nbytes,
                "roofline_tok_s": round(bandwidth * 1e9 / nbytes, 1)}  # fmt: skip
    llm = LLM(target, device="cuda", dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=2048,
              kv_cache_memory_gb=8.0)  # fmt: skip
    hf = hf_model(target, torch.bfloat16, "cuda")
    hf.generation_config.eos_token_id = None  # random weights: run every row to its length
    prompt = [1] + list(range(100, 131))
    eager = LLM(target, device="cuda", dtype="bfloat16", max_num_seqs=1, kv_cache_memory_gb=1.0, cuda_graphs=False)
    decode = {"engine_tok_s": decode_rate(engine_runner(llm, prompt)),
              "engine_eager_tok_s": decode_rate(engine_runner(eager, prompt)),
              "transformers_tok_s": decode_rate(hf_runner(hf, prompt))}  # fmt: skip
    del eager
    decode["engine_fraction_of_roofline"] = round(decode["engine_tok_s"] / roofline["roofline_tok_s"], 3)
    result.add("batch-1 decode beside the HBM roofline", decode["engine_tok_s"] > 0, **roofline, **decode)
    prompts, outs = mixed_workload()
    rows: dict[str, Any] = {"engine": engine_mixed(llm, prompts, outs), "hf_static": hf_static(hf, prompts, outs)}
    try:
        rows["hf_continuous"] = hf_continuous(hf, prompts, outs)
    except Exception as err:  # noqa: BLE001 - transformers' own feature; its failure is a report line
        rows["hf_continuous"] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    result.add("64 mixed requests", rows["engine"]["tokens"] == sum(outs), **rows)


if __name__ == "__main__":
    part_main("speed", run)
