"""Quantize a model with llm-compressor's GPTQ and AWQ on CPU, on calibration rows Warsha gives it,
and write each result as a plain float HF model (weights already on the integer grid).

Why plain float: the perplexity of every method (Warsha's and llm-compressor's) is then measured
by the *same* evaluator in the project venv (``benchmarks/quant_bench.py``), on the same
documents, so differences come from the quantizers and not from two transformers versions.

Runs inside the peer venv (``benchmarks/peers/make_venv.sh``); ``quant_bench.py`` calls it:

    /work/venvs/peers/bin/python benchmarks/peers/llmcompressor_quant.py JOB.pt OUT_DIR

``JOB.pt`` (``torch.save``) holds ``model`` (path), ``calib`` (int64 ``[n, seq]`` token ids),
``bits``, ``group_size``, ``methods`` (subset of ``["gptq", "awq"]``), ``ignore`` (module names
to leave in float, e.g. linears the group size does not divide), ``gptq_actorder``
(``"static"``, llm-compressor's default, or ``None``), ``threads``. Writes
``OUT_DIR/<method>/`` (model) and ``OUT_DIR/result.json`` (wall time of ``oneshot`` itself,
levels per group as a check that the weights really are quantized, or the error).

Mappings: llm-compressor's own Llama AWQ mappings, except that a mapping whose balance layers
are all ignored is dropped (it would divide by zero, see ``awq_mappings``).

CPU workaround: llm-compressor's AWQ pins its activation cache with ``Tensor.pin_memory()``,
which raises "Cannot access accelerator device when none is available" on a machine without
one; pinning only speeds host-to-device copies, so it is made a no-op here.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def cpu_workarounds() -> list[str]:
    """Make llm-compressor's accelerator-only conveniences no-ops on a CPU-only machine."""
    import torch

    if torch.accelerator.is_available():
        return []
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
    return ["IntermediatesCache.pin_memory disabled (no accelerator)"]


def scheme(bits: int, group_size: int, symmetric: bool) -> dict[str, Any]:
    """A weight-only group scheme (``W4A16`` is this with bits 4, group 128, symmetric)."""
    return {
        "targets": ["Linear"],
        "weights": {
            "num_bits": bits,
            "type": "int",
            "symmetric": symmetric,
            "strategy": "group",
            "group_size": group_size,
        },
    }


def recipe(method: str, job: dict[str, Any]) -> list[Any]:
    """GPTQ: symmetric (as Warsha's default). AWQ: asymmetric, scales then RTN (llm-compressor's split)."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    ignore = ["lm_head", *job.get("ignore", [])]
    if method == "gptq":
        groups = {"group_0": scheme(job["bits"], job["group_size"], True)}
        return [GPTQModifier(config_groups=groups, ignore=ignore, actorder=job.get("gptq_actorder", "static"))]
    groups = {"group_0": scheme(job["bits"], job["group_size"], False)}
    return [
        AWQModifier(mappings=awq_mappings(job.get("ignore", []))),
        QuantizationModifier(config_groups=groups, ignore=ignore),
    ]


def awq_mappings(ignore: list[str]) -> list[Any]:
    """llm-compressor's Llama mappings, minus those whose balance layers are all left in float.

    Its AWQ divides by the number of *quantized* balance layers of a mapping: a mapping whose
    layers are all ignored (the demo's down_proj at group 128) raises ZeroDivisionError.
    Warsha's AWQ skips such a group too, so both search the same scaling groups.
    """
    from llmcompressor.modifiers.transform.awq.mappings import AWQMapping

    table = [
        ("input_layernorm", ["q_proj", "k_proj", "v_proj"]),
        ("v_proj", ["o_proj"]),
        ("post_attention_layernorm", ["gate_proj", "up_proj"]),
        ("up_proj", ["down_proj"]),
    ]
    ignored = {name.rsplit(".", 1)[-1] for name in ignore}
    return [
        AWQMapping(f"re:.*{smooth}$", [f"re:.*{b}$" for b in balance])
        for smooth, balance in table
        if not set(balance) <= ignored
    ]


def fake_quantized_state(model: Any, reference_keys: set[str]) -> tuple[dict[str, Any], int]:
    """The model's tensors with every quantized linear's weight put through its own qdq."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    levels = 0
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k in reference_keys}
    for name, module in model.named_modules():
        qscheme = getattr(module, "quantization_scheme", None)
        if qscheme is None or qscheme.weights is None or not hasattr(module, "weight_scale"):
            continue
        zp = getattr(module, "weight_zero_point", None)
        with torch.no_grad():
            w = fake_quantize(module.weight, module.weight_scale, zp, qscheme.weights)
        state[f"{name}.weight"] = w.detach().clone()
        gs = qscheme.weights.group_size
        groups = w.reshape(w.shape[0], -1, gs)
        levels = max(
            levels,
            max(len(torch.unique(groups[r, g])) for r in range(min(4, w.shape[0])) for g in range(groups.shape[1])),
        )
    return state, levels


def run_one(method: str, job: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """One oneshot run; returns its timing and checks."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    rows = job["calib"]
    data = Dataset.from_dict({"input_ids": rows.tolist(), "attention_mask": torch.ones_like(rows).tolist()})
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    keys = set(model.state_dict())
    start = time.perf_counter()
    oneshot(
        model=model,
        dataset=data,
        recipe=recipe(method, job),
        num_calibration_samples=rows.shape[0],
        max_seq_length=rows.shape[1],
        pipeline="sequential",
    )
    wall = time.perf_counter() - start
    state, levels = fake_quantized_state(model, keys)
    target = out_dir / method
    target.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in state.items()}, str(target / "model.safetensors"), metadata={"format": "pt"}
    )
    for f in Path(job["model"]).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.suffix in (".json", ".model", ".txt"):
            shutil.copy2(f, target / f.name)
    return {"seconds": wall, "max_levels_per_group": levels, "model_dir": str(target)}


def main() -> None:
    import torch

    job_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    job = torch.load(job_path, weights_only=False)
    torch.set_num_threads(int(job.get("threads", 1)))
    import compressed_tensors
    import llmcompressor

    out: dict[str, Any] = {
        "library": f"llmcompressor {llmcompressor.__version__}",
        "compressed_tensors": compressed_tensors.__version__,
        "torch": torch.__version__,
        "workarounds": cpu_workarounds(),
    }
    for method in job["methods"]:
        try:
            out[method] = run_one(method, job, out_dir)
        except Exception as exc:  # a peer failing on CPU is a result to report, not a crash
            out[method] = {
                "error": f"{type(exc).__name__}: {str(exc)[:500]}",
                "traceback": traceback.format_exc()[-2000:],
            }
        print(method, json.dumps(out[method]), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "result.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
