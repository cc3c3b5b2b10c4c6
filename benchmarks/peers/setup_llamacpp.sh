#!/usr/bin/env bash
# Build llama.cpp's Python binding in its own venv for benchmarks/serve_peers.py (never the project's
# .venv: the binding is compiled for this CPU and the converter wants its own transformers).
#   bash benchmarks/peers/setup_llamacpp.sh            # -> ${WARSHA_PEERS_CACHE:-~/.cache/warsha-peers}/llamacpp
#   bash benchmarks/peers/setup_llamacpp.sh DIR        # -> DIR
# llama-cpp-python 0.3.36 ships only an sdist: pip compiles it with the system cmake and g++
# (GGML_NATIVE: the kernels this CPU has). The compile runs under `nice -n 19` so that it does not
# starve other work on a shared host. The sdist is also unpacked beside the venv (src/) because its
# vendor/llama.cpp/convert_hf_to_gguf.py converts HF checkpoints to GGUF; that converter needs torch
# (the local CPU wheel goes in first and alone so nothing pulls a CUDA build), transformers and
# sentencepiece. A stamp file makes a rerun free once everything is in place; delete it to rebuild.
set -euo pipefail
VERSION=0.3.36
VENV="${1:-${WARSHA_PEERS_CACHE:-$HOME/.cache/warsha-peers}/llamacpp}"
STAMP="$VENV/.warsha-ready-$VERSION"
if [ -f "$STAMP" ]; then
    echo "llama.cpp venv ready (cached): $VENV"
    exit 0
fi
PIP="$VENV/bin/pip --disable-pip-version-check"
test -x "$VENV/bin/python" || python3.11 -m venv "$VENV" || python3 -m venv "$VENV"
$PIP install -q torch==2.13.0+cpu
$PIP install -q numpy==2.4.6 transformers==5.23.0 sentencepiece==0.2.3 protobuf==7.36.2 safetensors==0.8.0 gguf==0.19.0
# The converter: unpack the same sdist pip builds from.
if [ ! -f "$VENV/src/llama_cpp_python-$VERSION/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
    mkdir -p "$VENV/src"
    $PIP download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$VENV/src"
    tar -xzf "$VENV/src/llama_cpp_python-$VERSION.tar.gz" -C "$VENV/src"
fi
if ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
    CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 nice -n 19 \
        $PIP install -q --no-binary :all: --no-deps "$VENV/src/llama_cpp_python-$VERSION.tar.gz"
    $PIP install -q "llama-cpp-python==$VERSION"  # its pure-Python dependencies (already built: no recompile)
fi
"$VENV/bin/python" - <<'PY'
import llama_cpp, torch, transformers
print("llama.cpp venv:", llama_cpp.__version__, "torch", torch.__version__, "transformers", transformers.__version__)
PY
touch "$STAMP"
echo "llama.cpp venv ready: $VENV"
