"""Convert an HF checkpoint for llama.cpp and time its batch-1 greedy decode: the llama.cpp side of serve_peers.py.

Runs inside the venv that setup_llamacpp.sh builds (never the project's .venv):

    VENV/bin/python benchmarks/peers/llamacpp_runner.py SPEC.json

SPEC holds `stage_dir` (the checkpoint laid out for the converter), `gguf_dir` (this checkpoint's
cache: conversions are reused while the checkpoint's size and mtime match), `converter` (the sdist's
vendor/llama.cpp/convert_hf_to_gguf.py), `formats` (a list of "f16", "q4_0" and "q4_k_m"), `threads`, `prompt`
(token ids), `new_tokens` and `out` (where the result JSON goes).

The converter reads the tokenizer beside the weights. The benchmark's random checkpoints have none;
serve_peers stages them with a placeholder tokenizer in the project's venv
(`serve.peer_compare.staged_checkpoint`) before this runs. Q4_0 comes from the F16 file through
`llama_model_quantize` (ftype 2, llama.cpp's own choice of types per tensor).
Decode feeds the prompt in one `eval`, then one token per `eval`, taking the argmax of the last row's
logits (greedy); TPOT is the mean time of the one-token steps.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FTYPES = {"f16": 1, "q4_0": 2, "q4_k_m": 15}  # llama_ftype values
ROOT = Path(__file__).resolve().parents[2]


def gguf_tool() -> Any:
    """The stage's llama.cpp helpers (``quantize/gguf_tool.py``, standard library only), loaded by
    path: this runner runs in the llama.cpp venv, outside the project's packages."""
    spec = importlib.util.spec_from_file_location("gguf_tool", ROOT / "quantize" / "gguf_tool.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module  # llama_ftype: LLAMA_FTYPE_MOSTLY_F16, LLAMA_FTYPE_MOSTLY_Q4_0


def gguf_file(spec: dict[str, Any], fmt: str) -> Path:
    """The GGUF file of `fmt` for the spec's checkpoint, converted or quantized once and cached."""
    import llama_cpp

    root, stage = Path(spec["gguf_dir"]), Path(spec["stage_dir"])
    f16 = root / "model-f16.gguf"
    if not f16.is_file():
        tmp = f16.with_suffix(".part")
        cmd = [sys.executable, spec["converter"], str(stage), "--outfile", str(tmp), "--outtype", "f16"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        tmp.rename(f16)
    if fmt == "f16":
        return f16
    out = root / f"model-{fmt}.gguf"
    if not out.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = FTYPES[fmt]
        params.nthread = int(spec.get("threads", 2))
        tmp = out.with_suffix(".part")
        rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(tmp).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({fmt}) returned {rc}")
        tmp.rename(out)
    return out


def tensor_bytes(path: Path) -> dict[str, int]:
    """Bytes of the file's tensors: all, and those a decode step reads (all but the token embedding
    table, unless the model ties its output to it: without an ``output.weight`` the head reads it)."""
    from gguf import GGUFReader

    tensors = GGUFReader(str(path)).tensors
    total = sum(int(t.n_bytes) for t in tensors)
    tied = not any(t.name == "output.weight" for t in tensors)
    embed = 0 if tied else sum(int(t.n_bytes) for t in tensors if t.name == "token_embd.weight")
    types = sorted({t.tensor_type.name for t in tensors})
    return {"all": total, "decode_read": total - embed, "types": types}  # type: ignore[dict-item]


def greedy_decode(path: Path, prompt: list[int], new_tokens: int, threads: int) -> dict[str, Any]:
    """Prefill `prompt`, then `new_tokens` one-token greedy steps; TTFT, TPOT and the ids."""
    import llama_cpp
    import numpy as np

    n_ctx = len(prompt) + new_tokens + 16
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    n_vocab = llm.n_vocab()

    def last_argmax() -> int:
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).argmax())

    llm.eval(prompt[:8])  # warm-up: page the weights in, build the graphs
    llm.eval([last_argmax()])
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    tok = last_argmax()
    first = time.perf_counter()
    out = [tok]
    for _ in range(new_tokens - 1):
        llm.eval([tok])
        tok = last_argmax()
        out.append(tok)
    end = time.perf_counter()
    tpot = (end - first) / max(1, new_tokens - 1)
    return {"ttft_s": first - start, "tpot_s": tpot, "tok_per_s": 1 / tpot, "outputs": out}


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    threads = int(spec.get("threads", 2))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import llama_cpp

    result: dict[str, Any] = {"llama_cpp_python": llama_cpp.__version__, "formats": {}}
    tool = gguf_tool()
    result["extra_buffer_types"] = not tool.amx_host()  # llama.cpp's AMX path faults on AMX hosts
    if not result["extra_buffer_types"]:
        tool.skip_extra_buffers()
    for fmt in spec["formats"]:
        try:
            path = gguf_file(spec, fmt)
            r = greedy_decode(path, list(spec["prompt"]), int(spec["new_tokens"]), threads)
            r["bytes"] = tensor_bytes(path)
            r["gguf"] = str(path)
            result["formats"][fmt] = r
        except Exception as exc:  # the caller reports a failing format instead of losing the others
            result["formats"][fmt] = {"error": f"{type(exc).__name__}: {exc}"}
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: llamacpp_runner.py SPEC.json (see the module docstring for its fields)")
    sys.exit(main(sys.argv[1]))
