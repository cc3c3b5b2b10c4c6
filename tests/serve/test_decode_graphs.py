"""Decode forwards replayed from static buffers (`serve.decode_graphs`) against the eager engine.

Off CUDA the capture is `replay_by_call`: each "replay" runs the captured function over the same
static buffers, so what is checked here is what a CUDA graph would compute from them: padding to
the bucket, block tables wider than the batch's, the decode grid sized for the whole context,
per-group metadata (Gemma 3's sliding layers), the draft's graphs beside the target's. The Triton
backend runs under its interpreter (tests/conftest.py). Greedy tokens must equal the eager
engine's, with prefix caching and chunked prefill on, with and without speculative decoding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serve import LLM, SamplingParams, decode_graphs
from serve.attention import SeqChunk, get_backend
from serve.config import ModelConfig
from serve.kv_layout import layout_for
from serve.model import DecoderModel, ForwardBatch
from warsha.engine_check import Workload, engine_kwargs, pool_blocks, prompts
from warsha.random_models import FAMILY_CONFIGS, make_layer_skip_draft, make_model

# a roomy pool: the three requests decode together, so a batch of three replays padded to four
WORKLOAD = Workload(num_prompts=4, shared_prefix=10, suffix=4, max_tokens=6, max_num_batched_tokens=12, spare_blocks=32)
FAMILIES = {"llama": dict(arch="llama"), **FAMILY_CONFIGS}


def test_buckets() -> None:
    """1, 2, 4, then multiples of 8, ending at the largest batch."""
    assert decode_graphs.buckets(1) == [1]
    assert decode_graphs.buckets(3) == [1, 2, 3]
    assert decode_graphs.buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_graphs.buckets(64)[-3:] == [48, 56, 64]


def _generate(target: Path, draft: Path | None, graphs: bool) -> tuple[list[list[int]], LLM]:
    """The workload through the Triton-backend engine, eager or with graphs on every model
    (buckets 1, 2, 4: a batch of three replays padded)."""
    config = ModelConfig.from_dir(target)
    ps = prompts(WORKLOAD, config.vocab_size)
    blocks = pool_blocks(WORKLOAD, len(ps[-1]), layout_for(config.layer_windows).group_windows)
    kwargs = engine_kwargs(WORKLOAD, blocks, device="cpu", attention_backend="triton", dtype="float32")
    llm = LLM(target, draft, **kwargs)
    if graphs:
        r, max_len = llm.runner, llm.max_model_len
        for model, kv in ((r.target, r.target_kv), (r.draft, r.draft_kv)):
            if model is not None:
                assert decode_graphs.install(model, kv, 4, max_len, decode_graphs.replay_by_call) is not None
    params = SamplingParams(max_tokens=WORKLOAD.max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(ps[:1], params) + llm.generate(ps[1:], params)
    return [o.token_ids for o in outs], llm


@pytest.mark.parametrize(("family", "speculate"), [("llama", True), ("gemma3", False)])
def test_graphed_decode_matches_eager(family: str, speculate: bool, tmp_path: Path) -> None:
    """Identical greedy tokens. With a draft, the draft's single-token forwards replay (the
    target's verification chunks are k + 1 tokens: eager); without, the target's decode batches
    replay, a batch of three padded to four."""
    target = make_model(tmp_path / "target", seed=7, **FAMILIES[family])
    draft = make_layer_skip_draft(target, tmp_path / "draft", num_layers=1) if speculate else None
    eager, _ = _generate(target, draft, graphs=False)
    graphed, llm = _generate(target, draft, graphs=True)
    assert graphed == eager
    assert llm.scheduler.prefix_hit_tokens > 0
    if speculate:
        assert llm.runner.draft.decode_graph.replays > 0 and llm.stats.spec_proposed > 0
    else:
        assert llm.runner.target.decode_graph.replays > 0 and llm.runner.target.decode_graph.padded_rows > 0


def test_padded_replay_writes_what_eager_writes(tmp_path: Path) -> None:
    """One decode batch of three through a bucket of four: the same logits as the eager forward
    and the same KV cache, every slot of it (a padded row writes nothing, block 0 included)."""
    target = make_model(tmp_path / "target", seed=7, **FAMILIES["gemma3"])
    model = DecoderModel.load(target, torch.float32, get_backend("cpu", prefer="triton"), "cpu")
    groups = model.kv_layout.num_groups
    caches = [model.new_kv_cache(1 + 6 * groups, 4) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    for cache in caches:  # the same random history in both
        for t in (cache.k, cache.v):
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1)))
    lengths = [5, 9, 2]
    tables = [[1, 2], [3, 4, 5], [6]]
    # each block group's tables: the same shapes, blocks 6 further on per group; block 0 in none
    more = [tuple([b + 6 * g for b in tables[i]] for g in range(1, groups)) for i in range(3)]
    chunks = [SeqChunk(i, 1, n, tables[i], more[i]) for i, n in enumerate(lengths)]
    batch = ForwardBatch(
        input_ids=torch.randint(3, 64, (3,), generator=gen),
        positions=torch.tensor([n - 1 for n in lengths]),
        chunks=chunks,
        logits_indices=torch.arange(3),
    )
    eager = model.forward(batch, caches[0])
    graphs = decode_graphs.install(model, caches[1], 4, 64, decode_graphs.replay_by_call)
    graphed = model.forward(batch, caches[1])
    assert graphs.replays == 1 and graphs.padded_rows == 1
    torch.testing.assert_close(graphed, eager, rtol=0, atol=1e-5)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
