#!/usr/bin/env bash
# Create the peer venv the quantize benchmarks and the slow peer test use (never the project's
# .venv: llmcompressor pins transformers 5.17.0 and gptqmodel downgrades numpy to 2.2.6).
#   bash benchmarks/peers/make_venv.sh            # -> /work/venvs/peers
#   bash benchmarks/peers/make_venv.sh DIR        # -> DIR
# torch goes in FIRST and alone, as the Makefile does: any other order lets a dependency pull a
# multi-GB CUDA build. Measured: about 4 minutes, `pip check` clean. Idempotent.
set -euo pipefail
VENV="${1:-/work/venvs/peers}"
PIP="$VENV/bin/pip --disable-pip-version-check"
test -x "$VENV/bin/python" || python3.11 -m venv "$VENV" || python3 -m venv "$VENV"
$PIP install -q torch==2.13.0
$PIP install -q llmcompressor==0.14.0.1
$PIP install -q gptqmodel==7.6.0
$PIP check
"$VENV/bin/python" -c "import torch, transformers, llmcompressor, gptqmodel; print('peer venv ready:', torch.__version__, transformers.__version__, llmcompressor.__version__, gptqmodel.__version__)"
