"""The llama.cpp side of ``quantize.gguf``: runs inside the llama.cpp venv, never the project's.

    LLAMACPP_VENV/bin/python quantize/gguf_tool.py SPEC.json

Why a separate process: llama-cpp-python is compiled for this CPU and lives in its own venv
(``benchmarks/peers/setup_llamacpp.sh``), so the stage hands it a JSON spec and reads a JSON
result. This file imports only the standard library at module level (the stage imports
``FTYPES`` from it) and nothing of the project (it runs by path from another interpreter).

SPEC fields: ``f16`` (the converted F16 GGUF), ``out_dir``, ``types`` (names of ``FTYPES``),
``threads``, ``texts`` ({lang: [[text, hf_ids], ...]}: the tokenization check), ``docs``
({lang: [ids, ...]}, BOS first) with ``windows`` ({lang: [[doc, begin, end, scored], ...]}:
the sliding windows ``warsha.evaluate`` scores), ``prompts`` (token ids), ``max_tokens``,
``speed_tokens`` and ``result`` (where the JSON goes). The result: per type its file, bytes,
per-document NLLs and decode tokens/s; the F16 greedy continuations; the texts whose
llama.cpp tokenization differs; whether llama.cpp's extra buffer types were on (``amx_host``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

# llama.h's llama_ftype values of the types a recipe may list.
FTYPES = {
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q2_K": 10,
    "Q3_K_S": 11,
    "Q3_K_M": 12,
    "Q3_K_L": 13,
    "Q4_K_S": 14,
    "Q4_K_M": 15,
    "Q5_K_S": 16,
    "Q5_K_M": 17,
    "Q6_K": 18,
    "BF16": 32,
}


def quantize(f16: Path, out: Path, name: str, threads: int) -> Path:
    """``out`` quantized from the F16 file with llama.cpp's own per-tensor choices for ``name``."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[name]
    params.nthread = threads
    tmp = out.with_suffix(".part")
    rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(tmp).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({name}) returned {rc}")
    tmp.rename(out)
    return out


def amx_host() -> bool:
    """Whether this CPU reports AMX tiles (``amx_int8`` in ``/proc/cpuinfo``).

    Why: llama.cpp 0.3.36's AMX matmul, the extra buffer type it puts quantized weights in on
    such CPUs, dies with SIGILL on a Sapphire Rapids VM (``tilezero`` in an OpenMP worker whose
    tiles were never configured; AMX itself works there once a thread configures its tiles),
    so on AMX hosts the tools load models without extra buffer types: llama.cpp's plain CPU
    kernels, AVX-512 included, run instead.
    """
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def skip_extra_buffers() -> None:
    """Make every later ``llama_cpp.Llama`` load with ``use_extra_bufts = False`` (AMX, repacking)."""
    import llama_cpp.llama_cpp as lc

    default = lc.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    lc.llama_model_default_params = params


def load(path: Path, n_ctx: int, threads: int, logits_all: bool = False) -> Any:
    """A ``llama_cpp.Llama`` on ``path`` (quiet)."""
    import llama_cpp

    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=max(n_ctx, 8),
        n_ubatch=max(n_ctx, 8),
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=logits_all,
        verbose=False,
    )


def tokenization_diffs(path: Path, texts: dict[str, list[list[Any]]]) -> dict[str, list[int]]:
    """Per language, the indices of texts llama.cpp tokenizes differently from the HF tokenizer."""
    llm = load(path, 64, 1)
    out: dict[str, list[int]] = {}
    for lang, pairs in texts.items():
        out[lang] = [
            i
            for i, (text, ids) in enumerate(pairs)
            if llm.tokenize(text.encode("utf-8"), add_bos=False, special=False) != ids
        ]
    return out


def doc_nll(llm: Any, docs: list[list[int]], windows: list[list[int]]) -> list[float]:
    """Each document's summed NLL (nats) over the given windows (targets scored once each)."""
    import numpy as np

    nll = [0.0] * len(docs)
    for d, begin, end, scored in windows:
        ids = docs[d][begin:end]
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
        rows = logits[len(ids) - scored - 1 : len(ids) - 1]
        targets = np.asarray(ids[len(ids) - scored :])
        top = rows.max(axis=1, keepdims=True)
        logz = np.log(np.exp(rows - top).sum(axis=1)) + top[:, 0]
        nll[d] += float((logz - rows[np.arange(scored), targets]).sum())
    return nll


def greedy(llm: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """``max_tokens`` greedy ids after ``prompt`` (argmax of the last logits; EOS not special,
    as serve's ``ignore_eos`` run it is compared with)."""
    llm.reset()
    llm.eval(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(int(llm.scores[llm.n_tokens - 1].argmax()))
        if len(out) < max_tokens:
            llm.eval(out[-1:])
    return out


def decode_speed(llm: Any, prompt: list[int], new_tokens: int) -> float:
    """Batch-1 greedy decode tokens/s after a warm-up (the prefill is not counted)."""
    greedy(llm, prompt[:8], 4)  # page the weights in, build the graphs
    llm.reset()
    llm.eval(prompt)
    tok = int(llm.scores[llm.n_tokens - 1].argmax())
    start = time.perf_counter()
    for _ in range(new_tokens):
        llm.eval([tok])
        tok = int(llm.scores[llm.n_tokens - 1].argmax())
    return new_tokens / (time.perf_counter() - start)


def measure(path: Path, spec: dict[str, Any], f16: bool) -> dict[str, Any]:
    """NLLs, speed (and for the F16 file the greedy continuations) of one GGUF file."""
    threads = int(spec["threads"])
    longest = max([e - b for w in spec["windows"].values() for _, b, e, _ in w] + [8])
    prompt_len = max((len(p) for p in spec["prompts"]), default=8)
    n_ctx = max(longest, prompt_len + max(int(spec["max_tokens"]), int(spec["speed_tokens"])) + 8)
    llm = load(path, n_ctx, threads, logits_all=True)
    out: dict[str, Any] = {"file": str(path), "bytes": path.stat().st_size}
    out["nll"] = {lang: doc_nll(llm, spec["docs"][lang], w) for lang, w in spec["windows"].items()}
    if f16:
        out["greedy"] = [greedy(llm, p, int(spec["max_tokens"])) for p in spec["prompts"]]
    if spec["prompts"]:
        out["decode_tokens_per_s"] = decode_speed(llm, spec["prompts"][0], int(spec["speed_tokens"]))
    return out


def main(spec_path: str) -> int:
    """Quantize, check the tokenizer, measure every file, write the result JSON."""
    spec = json.loads(Path(spec_path).read_text())
    import llama_cpp

    f16 = Path(spec["f16"])
    result: dict[str, Any] = {"llama_cpp_python": llama_cpp.__version__, "types": {}}
    result["extra_buffer_types"] = not amx_host()
    if not result["extra_buffer_types"]:
        skip_extra_buffers()
    result["tokenization_diffs"] = tokenization_diffs(f16, spec["texts"])
    result["types"]["F16"] = measure(f16, spec, f16=True)
    for name in spec["types"]:
        if name == "F16":
            continue
        path = quantize(f16, Path(spec["out_dir"]) / f"model-{name}.gguf", name, int(spec["threads"]))
        result["types"][name] = measure(path, spec, f16=False)
    for r in result["types"].values():
        assert all(math.isfinite(x) for v in r["nll"].values() for x in v), f"non-finite NLL in {r['file']}"
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: gguf_tool.py SPEC.json (see the module docstring for its fields)")
    sys.exit(main(sys.argv[1]))
