"""The OpenAI-compatible HTTP server for Warsha's engine (FastAPI + uvicorn, SSE streaming).

    python -m serve ARTIFACT_DIR [--draft DIR] [--port 8000]     (or: warsha serve ...)

- ``cli``: flags, engine construction, ``main``; imports FastAPI only after parsing, so
  ``--help`` is instant;
- ``app``: the routes; handlers validate, admit, then relay the engine's deltas;
- ``guard``: API key, Content-Type and body-size checks in front of every route;
- ``protocol``: the request schemas and their translation into ``SamplingParams``;
- ``async_engine``: the engine's background thread and the per-request delta queues;
- ``formatting``: completion and chat response bodies, streamed or whole;
- ``chat_template``: the model's own Jinja chat template, sandboxed;
- ``metrics``: Prometheus histograms and the ``/metrics`` text.
"""

from __future__ import annotations

from typing import Any

from serve.api.cli import main

__all__ = ["build_app", "main"]


def __getattr__(name: str) -> Any:
    """``build_app`` on first use (PEP 562): importing the package stays free of FastAPI."""
    if name == "build_app":
        from serve.api.app import build_app

        return build_app
    raise AttributeError(f"module 'serve.api' has no attribute {name!r}")
