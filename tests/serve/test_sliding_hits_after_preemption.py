"""Prefix-cache hits of a sliding-window model after preemption, against transformers.

Found by `make gpu-check`'s engine part on CPU: Gemma 3 (sliding and full layers in separate
block groups) under a KV pool small enough to preempt, with prefix caching, generated tokens
that transformers did not. A re-admitted request's hits were taken group by group, and the full
group's new blocks, popped from the free list first, could be a sliding group's hit still
sitting there: one block then held new keys for one group and the cached ones for the other.
"""

from __future__ import annotations

from pathlib import Path

import torch

from serve import LLM, SamplingParams
from serve.config import ModelConfig
from serve.kv_layout import layout_for
from warsha.engine_check import Workload, engine_kwargs, hf_greedy, pool_blocks, prompts
from warsha.random_models import FAMILY_CONFIGS, hf_model, make_model


def test_gemma3_prefix_hits_after_preemption_match_transformers(tmp_path: Path) -> None:
    """Greedy tokens equal to transformers `generate`, with preemptions and prefix hits taken."""
    target = make_model(tmp_path / "target", seed=7, **FAMILY_CONFIGS["gemma3"])
    workload = Workload()
    config = ModelConfig.from_dir(target)
    ps = prompts(workload, config.vocab_size)
    blocks = pool_blocks(workload, len(ps[-1]), layout_for(config.layer_windows).group_windows)
    llm = LLM(target, None, **engine_kwargs(workload, blocks, dtype="float32"))
    params = SamplingParams(max_tokens=workload.max_tokens, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(ps[:1], params) + llm.generate(ps[1:], params)]
    assert llm.scheduler.num_preemptions > 0 and llm.scheduler.prefix_hit_tokens > 0
    llm.block_manager.check_no_leaks()
    assert got == hf_greedy(hf_model(target, torch.float32, "cpu"), ps, workload.max_tokens)
