"""Warsha's serving engine: paged KV cache, continuous batching, speculative decoding on CPU.

The public names are imported lazily so that the torch-free control plane
(`serve.sequence`, `serve.block_manager`, `serve.scheduler`) can be imported without torch.

    from serve import LLM, SamplingParams
    llm = LLM("path/to/model", draft_dir="path/to/draft")
    outs = llm.generate(["مرحبا"], SamplingParams(temperature=0, max_tokens=32))
    llm.stats.summary()
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "LLM": "serve.engine",
    "RequestOutput": "serve.engine",
    "SamplingParams": "serve.sampler",
    "EngineStats": "serve.stats",
    "AdmissionError": "serve.scheduler",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import public names on first use (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'serve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
