"""Command line of the HTTP server: `python -m serve ARTIFACT_DIR ...` and `warsha serve ...`.

The engine's flags are generated from `EngineArgs`' fields (`EngineArgs.add_cli_args`); only the
server's own options (address, API key, limits, logging) are listed here. Kept free of heavy
imports so `--help` answers at once; `main` parses with this parser, loads the engine, then runs
uvicorn.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from serve.api.guard import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_REQUEST_TIMEOUT  # stdlib only: --help stays fast
from serve.args import EngineArgs  # torch-free: its fields are the engine's flags

EXAMPLES = """examples:
  python -m serve runs/arabic-tiny/gptq --draft runs/arabic-tiny/draft --port 8000
  warsha serve runs/arabic-tiny/gptq --served-model-name warsha-ar --kv-cache-memory-gb 2
then:
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "warsha-ar", "prompt": "مرحبا", "max_tokens": 32, "temperature": 0}'
"""


def build_parser(prog: str = "python -m serve") -> argparse.ArgumentParser:
    """The server's argument parser (shared by `python -m serve` and `warsha serve`)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Serve an HF-format Llama-family model directory over an OpenAI-compatible HTTP API "
        "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics) with Warsha's CPU engine.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("artifact_dir", type=Path, help="model directory (config.json, *.safetensors, tokenizer.json)")
    p.add_argument(
        "--draft", type=Path, default=None, help="draft model directory for speculative decoding (same tokenizer)"
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; 0.0.0.0 exposes the server to the network (default: %(default)s)",
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    p.add_argument(
        "--served-model-name", default=None, help="the name clients pass as `model` (default: the directory name)"
    )
    EngineArgs.add_cli_args(p.add_argument_group("engine (serve.args.EngineArgs)"))
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for the engine (default: OMP_NUM_THREADS, else the physical cores)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("WARSHA_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on every path but --public-paths (default: $WARSHA_API_KEY, "
        "else no key)",
    )
    p.add_argument(
        "--public-paths",
        default="/health",
        help="comma-separated paths served without the API key, e.g. /health,/metrics (default: %(default)s)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body accepted; larger ones get HTTP 413 (default: %(default)s)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT,
        help="seconds a request may run before it is aborted with HTTP 504 (default: %(default)s)",
    )
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="serve without checking the files against the directory's warsha.json manifest",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="server log level (default: %(default)s)",
    )
    return p


def main(argv: list[str] | None = None, prog: str = "python -m serve") -> int:
    """Parse flags, load the engine, serve until interrupted; 2 on bad input."""
    args = build_parser(prog).parse_args(argv)  # before the heavy imports: --help stays instant
    for flag, path in (("ARTIFACT_DIR", args.artifact_dir), ("--draft", args.draft)):
        if path is not None and not (path / "config.json").is_file():
            print(f"error: {flag} {path}: no config.json there; give an HF-format model directory", file=sys.stderr)
            return 2
    from serve.manifest import ManifestError, verify_dir

    if not args.no_verify:
        try:
            for path in (args.artifact_dir, args.draft):
                if path is not None:
                    n = verify_dir(path)
                    print(f"{path}: {n} files match warsha.json" if n else f"{path}: no warsha.json; not verified")
        except ManifestError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    import uvicorn

    from serve.api.app import build_app, log
    from serve.api.guard import ServerOptions
    from serve.engine import LLM
    from serve.runtime import apply as apply_runtime

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    try:
        log.info("runtime: %s", apply_runtime(args.threads, reexec=True))  # allocator and threads before the weights
        options = ServerOptions(
            max_request_bytes=args.max_request_bytes,
            request_timeout=args.request_timeout,
            api_key=args.api_key,
            public_paths=tuple(p.strip() for p in args.public_paths.split(",") if p.strip()),
        )
        llm = LLM(args.artifact_dir, args.draft, EngineArgs.from_namespace(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    name = args.served_model_name or args.artifact_dir.resolve().name
    log.info(
        "serving %s as %r on http://%s:%d (%d KV blocks of %d tokens, max_model_len %d)",
        args.artifact_dir,
        name,
        args.host,
        args.port,
        llm.block_manager.num_blocks,
        llm.block_manager.block_size,
        llm.max_model_len,
    )
    app = build_app(llm, name, args.artifact_dir, options)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
