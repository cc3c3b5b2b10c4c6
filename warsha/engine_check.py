"""Greedy runs of the serving engine against a reference, with every scheduler path switched on.

One workload shape, shared by the Triton-engine test and the GPU check (`benchmarks.gpu_check`):
prompts that share a prefix (prefix-cache hits), a token budget below the longest prompt
(chunked prefill), a KV pool too small for every request at once (preemption) and a
same-family layer-skip draft (speculative decoding). Outputs are compared token by token; a
divergence is classified at its first differing token by the reference's own top-2 gap there,
so a flip between two near-equal logits (bf16 rounding) is told apart from a real mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Workload:
    """Prompt count and lengths, generated tokens, and the engine's squeeze on memory and budget."""

    num_prompts: int = 4
    shared_prefix: int = 24
    suffix: int = 6
    max_tokens: int = 12
    block_size: int = 4
    max_num_batched_tokens: int = 16
    spare_blocks: int = 1  # pool = the longest request's blocks (per block group) plus these
    num_speculative_tokens: int = 3


def prompts(workload: Workload, vocab: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts: BOS, a shared prefix, then a distinct suffix of growing length each."""
    g = torch.Generator().manual_seed(seed)
    shared = [1] + torch.randint(3, vocab, (workload.shared_prefix,), generator=g).tolist()
    return [
        shared + torch.randint(3, vocab, (workload.suffix * (i + 1),), generator=g).tolist()
        for i in range(workload.num_prompts)
    ]


def pool_blocks(workload: Workload, longest_prompt: int, group_windows: tuple[int | None, ...]) -> int:
    """A KV pool that holds the longest request (with its draft window) but not all at once."""
    from serve.block_manager import blocks_to_hold

    tokens = longest_prompt + workload.max_tokens + workload.num_speculative_tokens + 1
    held = blocks_to_hold(group_windows, workload.block_size, tokens, workload.max_num_batched_tokens)
    return held + workload.spare_blocks


def engine_kwargs(workload: Workload, num_kv_blocks: int, **extra: Any) -> dict[str, Any]:
    """EngineArgs fields that switch prefix caching, chunked prefill, preemption and speculation on."""
    return dict(
        block_size=workload.block_size,
        max_num_batched_tokens=workload.max_num_batched_tokens,
        num_kv_blocks=num_kv_blocks,
        enable_prefix_caching=True,
        num_speculative_tokens=workload.num_speculative_tokens,
        adaptive_speculation=False,
        **extra,
    )


def run_engine(
    model_dir: Path, draft_dir: Path | None, workload: Workload, seed: int = 0, **options: Any
) -> dict[str, Any]:
    """Generate the workload greedily (first prompt alone, so the rest hit its cached prefix).

    Returns the token lists and what the run exercised (prefix-hit tokens, preemptions, drafted
    and accepted tokens), so a caller can check each path was really taken."""
    from serve import LLM, SamplingParams
    from serve.config import ModelConfig
    from serve.kv_layout import layout_for

    config = ModelConfig.from_dir(model_dir)
    ps = prompts(workload, config.vocab_size, seed)
    windows = layout_for(config.layer_windows).group_windows
    llm = LLM(model_dir, draft_dir, **engine_kwargs(workload, pool_blocks(workload, len(ps[-1]), windows), **options))
    params = SamplingParams(max_tokens=workload.max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(ps[:1], params) + llm.generate(ps[1:], params)
    llm.block_manager.check_no_leaks()
    stats = llm.stats
    models = (llm.runner.target, llm.runner.draft)
    graphs = [m.decode_graph for m in models if m is not None and m.decode_graph is not None]
    return {
        "prompts": ps,
        "tokens": [o.token_ids for o in outs],
        "prefix_hit_tokens": llm.scheduler.prefix_hit_tokens,
        "preemptions": llm.scheduler.num_preemptions,
        "drafted": stats.spec_proposed,
        "accepted": stats.spec_accepted,
        "graph_replays": sum(g.replays for g in graphs),  # decode forwards replayed from CUDA graphs
    }


def hf_greedy(model: Any, prompt_list: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers `generate`, greedy, one prompt at a time (no padding in the reference).

    EOS neither stops nor is suppressed (the engine runs with `ignore_eos`): the generation
    config's EOS is cleared, which `min_new_tokens` would instead mask out of the argmax."""
    device = next(model.parameters()).device
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for p in prompt_list:
            ids = torch.tensor([p], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
            out.append(gen[0, len(p) :].tolist())
    return out


def top2_gap(model: Any, prefix: list[int]) -> tuple[float, set[int]]:
    """The reference's gap between its two best next-token logits after `prefix`, and those ids."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prefix], device=device)).logits[0, -1].float()
    top = torch.topk(logits, 2)
    return float(top.values[0] - top.values[1]), {int(i) for i in top.indices}


def compare(
    got: list[list[int]], want: list[list[int]], prompt_list: list[list[int]], model: Any, tie_tolerance: float
) -> dict[str, Any]:
    """Token-by-token verdict: identical, near-tie flips (top-2 gap < tolerance) or mismatches."""
    identical, ties, mismatches = 0, [], []
    for i, (a, b, p) in enumerate(zip(got, want, prompt_list)):
        if a == b:
            identical += 1
            continue
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        row = {"prompt": i, "position": at, "got": a[at : at + 1], "want": b[at : at + 1]}
        if at < min(len(a), len(b)):
            gap, top = top2_gap(model, p + b[:at])
            row["top2_gap"] = gap
            if gap < tie_tolerance and {a[at], b[at]} == top:
                ties.append(row)
                continue
        mismatches.append(row)
    return {"identical": identical, "of": len(want), "near_tie_flips": ties, "mismatches": mismatches}
