"""`python -m serve ARTIFACT_DIR ...`: the OpenAI-compatible HTTP server (see serve/api.py)."""

from serve.api_cli import main

raise SystemExit(main())
