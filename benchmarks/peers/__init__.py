"""Runners that execute inside the peers' own venvs (vLLM, llama.cpp, llm-compressor, GPTQModel).

Most are run as files by the benchmark that drives them; ``gptqmodel_load`` runs as
``python -m benchmarks.peers.gptqmodel_load`` from the repository root, because it reads
``quantize`` from this checkout.
"""
