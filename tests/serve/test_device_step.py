"""Off the CPU, a serving step builds no tensor on the host except the inputs it stages, and reads
nothing back except sampled ids (`serve.device_io`).

The engine runs on PyTorch's meta device, which stands in for a GPU: its tensors have shapes and
no values, and every tensor op is watched by a dispatch mode that records any op touching a CPU
tensor outside `device_io.staging()`. `device_io.to_host`, the one read-back, is patched to
return token 0 (a meta tensor has no values); any other read-back (`.item()`, `.tolist()`,
`bool(...)`) raises on meta and fails the request, which the test also catches. Prefix caching,
chunked prefill, preemption, speculative decoding with a draft model and prompt lookup, sampled
rows with top-k/top-p, penalties and logprobs all run, so each of those paths is covered.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import serve.args
from serve import LLM, SamplingParams, device_io
from serve.config import ModelConfig
from serve.kv_layout import layout_for
from warsha.engine_check import Workload, engine_kwargs, pool_blocks, prompts
from warsha.random_models import FAMILY_CONFIGS, make_layer_skip_draft, make_model

WORKLOAD = Workload(num_prompts=3, shared_prefix=10, suffix=4, max_tokens=6, max_num_batched_tokens=12)


class HostTensorWatch(TorchDispatchMode):
    """Records every op that reads or makes a CPU tensor while not staging."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not device_io.is_staging():
            leaves = tree_leaves((args, kwargs or {}, out))
            if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in leaves):
                ours = [f for f in traceback.extract_stack()[:-1] if "/serve/" in f.filename]
                where = "".join(traceback.format_list(ours[-3:]))
                self.found.append(f"{func}\n{where}")
        return out


def _zeros_like_list(t: torch.Tensor) -> list:
    """What `to_host` would return for `t`, with every value 0 (built without a tensor op)."""
    shape = list(t.shape)

    def build(dims: list[int]) -> Any:
        return 0 if not dims else [build(dims[1:]) for _ in range(dims[0])]

    return build(shape)


def _params() -> list[SamplingParams]:
    """A greedy row, a sampled one with top-k/top-p and a seed, one with penalties and logprobs."""
    base = dict(max_tokens=WORKLOAD.max_tokens, ignore_eos=True)
    return [
        SamplingParams(temperature=0, **base),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, **base),
        SamplingParams(temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.5, logprobs=2, **base),
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_meta_device_step_builds_nothing_on_the_host(
    family: str, dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step of a workload that takes every scheduler path: no CPU tensor op outside staging,
    no failed request, every request generates its tokens."""
    shape = {"llama": dict(arch="llama"), **FAMILY_CONFIGS}[family]
    target = make_model(tmp_path / "target", seed=7, **shape)
    draft = make_layer_skip_draft(target, tmp_path / "draft", num_layers=1)
    monkeypatch.setattr(serve.args, "DEVICES", (*serve.args.DEVICES, "meta"))
    monkeypatch.setattr(device_io, "to_host", _zeros_like_list)
    config = ModelConfig.from_dir(target)
    ps = prompts(WORKLOAD, config.vocab_size)
    blocks = pool_blocks(WORKLOAD, len(ps[-1]), layout_for(config.layer_windows).group_windows)
    kwargs = engine_kwargs(WORKLOAD, blocks, device="meta", dtype=dtype, prompt_lookup_max=3)
    llm = LLM(target, draft, **kwargs)
    watch = HostTensorWatch()
    with watch:
        first = llm.generate([ps[0]], _params()[:1])
        rest = llm.generate(ps[1:] + ps[:1], _params())
    assert not watch.found, f"{len(watch.found)} CPU tensor ops in steps:\n" + "\n".join(sorted(set(watch.found)))
    outputs = first + rest
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    assert all(len(o.token_ids) == WORKLOAD.max_tokens for o in outputs)
    assert llm.scheduler.prefix_hit_tokens > 0 and llm.scheduler.num_preemptions > 0
    assert llm.stats.spec_proposed > 0
