"""Stage ``quantize.gguf``: the artifact as llama.cpp GGUF files and an Ollama Modelfile.

llama.cpp's own converter (``convert_hf_to_gguf.py``) writes the F16 GGUF, llama.cpp's
quantizer the recipe's types (``Q8_0``, ``Q4_K_M``, ...); both run in the llama.cpp venv
(``benchmarks/peers/setup_llamacpp.sh``), never in the project's, through
``quantize/gguf_tool.py``. What the manifest proves about the files, measured on held-out text:

- tokenization: llama.cpp's tokenizer against the artifact's HF tokenizer, per language, the
  count of texts whose ids differ (an extended vocabulary the converter mishandled shows here);
- greedy continuations of the F16 GGUF against serve in float32 on the same prompts, every
  divergence classified by serve's top-2 gap as ``serve.validate`` does (near-tie flips are
  reported, not counted as mismatches);
- perplexity and bits per character of every file on the windows ``warsha.evaluate`` scores,
  each quantized type's increase over the F16 file with its paired standard error;
- file sizes and llama.cpp batch-1 decode tokens/s.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from quantize.evalstats import DocScores, relative_increase
from quantize.ollama import chat_format, chat_template, modelfile

TOOL = Path(__file__).with_name("gguf_tool.py")
SETUP = "bash benchmarks/peers/setup_llamacpp.sh"


def llamacpp_tools(venv: str) -> tuple[Path, Path]:
    """The llama.cpp venv's python and its converter; a clear error naming what is missing."""
    root = Path(os.path.expanduser(venv))
    python = root / "bin" / "python"
    missing = None
    if not python.is_file():
        missing = f"no Python at {python}"
    elif not list(root.glob(".warsha-ready-*")):
        missing = f"{root} is not finished (no .warsha-ready-* stamp: llama-cpp-python is missing or still building)"
    converters = sorted(root.glob("src/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if missing is None and not converters:
        missing = f"llama.cpp's convert_hf_to_gguf.py is not under {root}/src"
    if missing:
        raise FileNotFoundError(
            f"quantize.gguf: llama.cpp (llama-cpp-python and its convert_hf_to_gguf.py) is not available: {missing}."
            f" Set it up with: {SETUP} {root}   (or point llamacpp_venv: at an existing one)"
        )
    return python, converters[-1]


def convert_f16(python: Path, converter: Path, src: Path, out: Path) -> Path:
    """``src`` as an F16 GGUF through llama.cpp's converter (its own error text on failure)."""
    tmp = out.with_suffix(".part")
    cmd = [str(python), str(converter), str(src), "--outfile", str(tmp), "--outtype", "f16"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"quantize.gguf: convert_hf_to_gguf.py failed on {src}:\n{done.stderr[-3000:]}")
    tmp.rename(out)
    return out


def eval_docs(tokenizer: Any, texts: list[str], max_length: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each text's ids (BOS first) and the sliding windows scored over them, as ``warsha.evaluate.document_nll``."""
    from warsha.evaluate import windows

    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    ids = [bos + x for x in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
    wins = [[d, b, e, s] for d, doc in enumerate(ids) for b, e, s in windows(len(doc), max_length, max_length // 2)]
    return ids, wins


def build_spec(ctx: Any, p: Any, tokenizer: Any, f16: Path, prompts: list[list[int]]) -> tuple[dict, dict]:
    """The tool's spec, and the evaluation texts per language (for the character counts)."""
    corpus = ctx.corpus()
    held_out = {lang: corpus.texts(lang, "validation") for lang in p.eval_langs}
    for lang, docs in held_out.items():
        if not docs:
            raise ValueError(f"quantize.gguf: the corpus has no {lang!r} validation documents; fix eval_langs")
    checked = {lang: docs[: p.tokenize_documents] for lang, docs in held_out.items()}
    scored = {lang: docs[: p.eval_documents] for lang, docs in held_out.items()}
    spec: dict[str, Any] = {
        "f16": str(f16),
        "out_dir": str(ctx.out_dir),
        "types": list(p.types),
        "threads": p.threads,
        "texts": {
            lang: [[t, ids] for t, ids in zip(docs, tokenizer(docs, add_special_tokens=False)["input_ids"])]
            for lang, docs in checked.items()
        },
        "docs": {},
        "windows": {},
        "prompts": prompts,
        "max_tokens": p.max_tokens,
        "speed_tokens": p.speed_tokens,
        "result": str(ctx.checkpoint_dir / "gguf_result.json"),
    }
    for lang, docs in scored.items():
        spec["docs"][lang], spec["windows"][lang] = eval_docs(tokenizer, docs, p.eval_max_length)
    return spec, scored


def run_tool(python: Path, spec: dict[str, Any], threads: int) -> dict[str, Any]:
    """Run ``gguf_tool.py`` in the llama.cpp venv on ``spec``; its result."""
    path = Path(spec["result"]).with_name("gguf_spec.json")
    path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("PYTHONPATH", None)  # the tool imports nothing of the project, and no project package
    done = subprocess.run([str(python), str(TOOL), str(path)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"quantize.gguf: the llama.cpp tool failed:\n{done.stderr[-3000:]}")
    return json.loads(Path(spec["result"]).read_text())


def serve_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> tuple[Any, list[list[int]]]:
    """serve's float32 greedy continuations (EOS ignored, as the tool's) and the engine."""
    from serve.engine import LLM
    from serve.sampler import SamplingParams

    engine = LLM(model_dir, dtype="float32", max_num_seqs=1)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return engine, [list(o.token_ids) for o in outs]


def type_metrics(result: dict[str, Any], spec: dict[str, Any], scored: dict[str, list[str]]) -> dict[str, Any]:
    """Per GGUF type: size, perplexity and bits/char per language, increase over F16, tokens/s."""
    tokens = {lang: [max(len(d) - 1, 0) for d in docs] for lang, docs in spec["docs"].items()}
    chars = {lang: sum(len(t) for t in texts) for lang, texts in scored.items()}

    def scores(r: dict[str, Any], lang: str) -> DocScores:
        return DocScores.from_per_document({"nll": r["nll"][lang], "tokens": tokens[lang], "chars": chars[lang]})

    base = result["types"]["F16"]
    out = {}
    for name, r in result["types"].items():
        m: dict[str, Any] = {
            "file": Path(r["file"]).name,
            "size_bytes": r["bytes"],
            "decode_tokens_per_s": r.get("decode_tokens_per_s"),
        }
        for lang in spec["docs"]:
            m[lang] = scores(r, lang).as_dict()
            if name != "F16":
                rel, se = relative_increase(scores(r, lang), scores(base, lang))
                m[lang]["perplexity_increase_rel"], m[lang]["perplexity_increase_se"] = rel, se
        out[name] = m
    return out


def write_modelfile(src: Path, out_dir: Path, gguf_name: str, tokenizer: Any, params: dict[str, Any]) -> dict:
    """``Modelfile`` beside the GGUF: the chat family's template and stops, the EOS tokens."""
    fmt = chat_format(chat_template(src))
    eos = tokenizer.eos_token_id
    gen = src / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    texts = [t for t in tokenizer.convert_ids_to_tokens(ids) if t]
    (out_dir / "Modelfile").write_text(modelfile(gguf_name, fmt, texts, params))
    return {"from": gguf_name, "chat_format": fmt.name if fmt else None, "eos_tokens": texts}


def run_gguf(ctx: Any, p: Any) -> dict[str, Any]:
    """Entry point of ``quantize.gguf``."""
    from transformers import AutoTokenizer

    from warsha.serve_validate import compare_outputs, workload

    python, converter = llamacpp_tools(p.llamacpp_venv)  # before any work
    src = Path(ctx.model_dir)
    if not ctx.is_main:
        return {}
    tokenizer = AutoTokenizer.from_pretrained(src)
    prompts = workload(ctx, p)
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    ctx.log.info("quantize.gguf: converting %s to F16 GGUF with %s", src, converter)
    f16 = convert_f16(python, converter, src, ctx.out_dir / "model-F16.gguf")
    spec, scored = build_spec(ctx, p, tokenizer, f16, prompts)
    ctx.log.info("quantize.gguf: quantizing to %s and measuring in llama.cpp", ", ".join(p.types))
    result = run_tool(python, spec, p.threads)
    engine, served = serve_greedy(src, prompts, p.max_tokens)
    greedy = compare_outputs(engine, prompts, served, result["types"]["F16"]["greedy"], p.tie_tolerance)
    greedy["outputs_match"] = greedy["mismatched_requests"] == greedy["near_tie_flips"]
    greedy.update(prompts=len(prompts), max_tokens=p.max_tokens)
    target = p.modelfile_type or (p.types[-1] if p.types else "F16")
    metrics: dict[str, Any] = {
        "llama_cpp_python": result["llama_cpp_python"],
        "extra_buffer_types": result["extra_buffer_types"],  # off on AMX hosts (gguf_tool.amx_host)
        "converter": str(converter),
        "types": type_metrics(result, spec, scored),
        "tokenization": {
            lang: {"texts": len(spec["texts"][lang]), "differing": len(diff), "first_differing": diff[:5]}
            for lang, diff in result["tokenization_diffs"].items()
        },
        "greedy_f16_vs_serve_float32": greedy,
        "modelfile": write_modelfile(src, ctx.out_dir, f"model-{target}.gguf", tokenizer, p.ollama_parameters),
        "input_size_bytes": sum(f.stat().st_size for f in src.glob("*.safetensors")),
    }
    _log_summary(ctx, metrics)
    return metrics


def _log_summary(ctx: Any, m: dict[str, Any]) -> None:
    tok = ", ".join(f"{lang} {t['differing']}/{t['texts']}" for lang, t in m["tokenization"].items())
    g = m["greedy_f16_vs_serve_float32"]
    ctx.log.info(
        "quantize.gguf: tokenization differs on %s texts; F16 greedy vs serve: %d of %d diverged (%d near-ties)",
        *(tok, g["mismatched_requests"], g["prompts"], g["near_tie_flips"]),
    )
    for name, t in m["types"].items():
        ppl = ", ".join(f"{lang} ppl {t[lang]['perplexity']:.3f}" for lang in m["tokenization"])
        ctx.log.info(
            "quantize.gguf %s: %.1f MiB, %s, %.1f tok/s", name, t["size_bytes"] / 2**20, ppl, t["decode_tokens_per_s"]
        )
