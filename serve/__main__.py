"""`python -m serve ARTIFACT_DIR ...`: the OpenAI-compatible HTTP server (see serve/api/)."""

from serve.api.cli import main

raise SystemExit(main())
