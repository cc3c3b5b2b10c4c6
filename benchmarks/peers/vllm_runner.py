"""Run vLLM's CPU backend on token-id workloads and write JSON: the vLLM side of serve_peers.py.

Runs inside the venv that setup_vllm_cpu.sh builds (never the project's .venv):

    VENV/bin/python benchmarks/peers/vllm_runner.py SPEC.json

SPEC holds `model_dir`, `dtype` ("bfloat16" | "float32"), `threads`, `kv_cache_gb`, `max_model_len`,
`out` (where the result JSON goes) and `jobs`: a list of {"name", "requests": [[prompt_ids, max_tokens],
...]}. Every request is greedy with `ignore_eos`, fed as token ids (no tokenizer: the benchmark's
random checkpoints have none). One engine serves all jobs after a warm-up request; each job is one
`LLM.generate` call over all its requests, so a one-request job is batch-1 decode and a 64-request job
is the mixed workload. TTFT and TPOT come from the engine's own per-request timestamps (monotonic
clock, same process because VLLM_ENABLE_V1_MULTIPROCESSING=0), TTFT counted from the call.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _setup_env(spec: dict[str, Any]) -> None:
    """Environment vLLM reads at import: in-process engine, KV budget, thread binding."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(spec.get("kv_cache_gb", 2))
    threads = int(spec.get("threads", 2))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def run_job(llm: Any, requests: list[list[Any]]) -> dict[str, Any]:
    """One generate call over all requests; tokens/s, per-request TTFT/TPOT lists, outputs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p, _ in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True, detokenize=False) for _, n in requests
    ]
    start_mono, start = time.monotonic(), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    outputs, ttft, tpot = [], [], []
    for o in outs:
        ids = list(o.outputs[0].token_ids)
        outputs.append(ids)
        m = o.metrics
        if m is not None and m.first_token_ts:
            ttft.append(m.first_token_ts - start_mono)
            if len(ids) > 1:
                tpot.append((m.last_token_ts - m.first_token_ts) / (len(ids) - 1))
    tokens = sum(len(x) for x in outputs)
    return {
        "tokens": tokens,
        "seconds": wall,
        "tok_per_s": tokens / wall,
        "ttft_s": ttft,  # per request; the project's venv takes their percentiles (serve.stats)
        "tpot_s": tpot,
        "outputs": outputs,
    }


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    _setup_env(spec)
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(int(spec.get("threads", 2)))
    result: dict[str, Any] = {"vllm": vllm.__version__, "torch": torch.__version__, "dtype": spec["dtype"]}
    try:
        load_start = time.perf_counter()
        llm = LLM(
            model=spec["model_dir"],
            dtype=spec["dtype"],
            skip_tokenizer_init=True,
            max_model_len=int(spec.get("max_model_len", 1024)),
            max_num_seqs=int(spec.get("max_num_seqs", 64)),
            seed=0,
            disable_log_stats=False,
            **spec.get("engine_kwargs", {}),
        )
        result["load_seconds"] = time.perf_counter() - load_start
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
        llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8])], warm, use_tqdm=False)
        result["jobs"] = {job["name"]: run_job(llm, job["requests"]) for job in spec["jobs"]}
    except Exception as exc:  # the caller reports a failing peer instead of losing the other figures
        result["error"] = f"{type(exc).__name__}: {exc}"
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: vllm_runner.py SPEC.json (see the module docstring for its fields)")
    sys.exit(main(sys.argv[1]))
