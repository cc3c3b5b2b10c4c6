"""Load a Warsha GPTQ or AWQ-GEMM export with GPTQModel (a library Warsha did not write) on CPU
and compare it with Warsha's own torch reference (``quantize.dequant``).

Why: a checkpoint that only Warsha can read proves nothing about the format. GPTQModel reads
``quantization_config`` and the packed tensors with its own code and kernels (``TorchLinear`` for
GPTQ v1, ``AwqTorchLinear`` for AWQ GEMM). Two checks:

- weights: every quantized linear's weight as GPTQModel's kernel applies it, recovered by
  feeding it the identity matrix (``I @ W^T = W^T``, independent of how the kernel stores the
  codes), against Warsha's dequantized weight, measured in grid steps: below half a step, every
  code, zero and scale was decoded as written;
- logits on fixed token rows: GPTQModel's model (bf16: its CPU kernels accept only fp16/bf16)
  against the float32 reference must be no further off than the reference itself run in bf16
  (times ``--bf16-factor``); argmax agreement is reported (on a random tiny model near-ties make
  it a noisy figure, so it is not a criterion).

Runs inside the peer venv (see ``benchmarks/peers/make_venv.sh``):

    GPTQMODEL_CPU_WORKERS=2 /work/venvs/peers/bin/python -m benchmarks.peers.gptqmodel_load EXPORT_DIR

(from the repository root, which ``-m`` puts on the path: ``quantize.dequant`` is read from it).

Prints a summary and writes JSON to ``benchmarks/results/peer_load-<quant_method>.json`` (or
``--out``). Exits non-zero when the agreement thresholds (``--max-steps``,
``--bf16-factor``) are not met, so a test can call it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # this checkout, where results go
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # the default thread pool oversubscribes 2 cores
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
BACKENDS = {"gptq": "gptq_torch", "awq": "awq_torch"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export_dir", type=Path, help="a directory written by quantize.gptq/awq/rtn")
    p.add_argument("--backend", help="GPTQModel backend (default: gptq_torch or awq_torch)")
    p.add_argument("--rows", type=int, default=4, help="token rows for the logit comparison")
    p.add_argument("--tokens", type=int, default=64, help="tokens per row")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-steps", type=float, default=0.5, help="fail above this max |dW| in grid steps")
    p.add_argument(
        "--bf16-factor",
        type=float,
        default=2.0,
        help="fail when the peer's max logit error (vs the fp32 reference) exceeds this multiple of the"
        " reference's own bf16 error",
    )
    p.add_argument("--out", type=Path)
    return p.parse_args()


def token_rows(export_dir: Path, rows: int, tokens: int) -> Any:
    """Fixed pseudo-random ids (seed 0) inside the vocabulary, BOS first."""
    import torch

    cfg = json.loads((export_dir / "config.json").read_text())
    ids = torch.randint(3, cfg["vocab_size"], (rows, tokens), generator=torch.Generator().manual_seed(0))
    if cfg.get("bos_token_id") is not None:
        ids[:, 0] = cfg["bos_token_id"]
    return ids


def peer_weight(module: Any, in_features: int) -> Any:
    """``W[out, in]`` as the kernel applies it: its output for the identity input."""
    import torch

    eye = torch.eye(in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        out = module(eye)
    bias = getattr(module, "bias", None)
    if bias is not None:
        out = out - bias.to(out.dtype)
    return out.t().float()


def grid_steps(export_dir: Path, qnames: list[str], qc: dict[str, Any]) -> dict[str, Any]:
    """The quantization step ``scale[row, group(i)]`` of every weight, from the checkpoint."""
    import torch
    from safetensors import safe_open

    steps = {}
    for f in sorted(export_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            keys = set(st.keys())
            for name in qnames:
                if f"{name}.scales" not in keys:
                    continue
                scales = st.get_tensor(f"{name}.scales").float()  # [G, out]
                if f"{name}.g_idx" in keys:
                    g = st.get_tensor(f"{name}.g_idx").long()
                else:
                    g = torch.arange(scales.shape[0] * qc["group_size"]) // qc["group_size"]
                steps[name] = scales.t()[:, g]
    return steps


def compare_weights(peer_model: Any, ref_model: Any, steps: dict[str, Any]) -> dict[str, Any]:
    """Weight difference over every quantized linear, in grid steps and relative to max |W|.

    ``max_steps`` < 0.5 means every integer code, zero point and scale the peer decoded is the
    one Warsha wrote (one wrong code is a whole step; what remains is the peer's bf16 rounding).
    """

    worst_steps, worst_rel, worst_name, kinds = 0.0, 0.0, "", set()
    peer_modules = dict(peer_model.named_modules())
    ref_modules = dict(ref_model.named_modules())
    for name, step in steps.items():
        mod = peer_modules[name]
        kinds.add(type(mod).__name__)
        ref = ref_modules[name].weight.detach().float()
        diff = (peer_weight(mod, ref.shape[1]) - ref).abs()
        in_steps = float((diff / step.clamp(min=1e-12)).max())
        worst_rel = max(worst_rel, float(diff.max()) / max(float(ref.abs().max()), 1e-12))
        if in_steps >= worst_steps:
            worst_steps, worst_name = in_steps, name
    return {
        "linears": len(steps),
        "kernels": sorted(kinds),
        "max_steps": worst_steps,
        "max_rel": worst_rel,
        "worst": worst_name,
    }


def compare_logits(a: Any, b: Any) -> dict[str, float]:
    """Max/mean absolute difference, relative to the logits' range, and argmax agreement."""
    a, b = a.float(), b.float()
    diff = (a - b).abs()
    return {
        "max_abs": float(diff.max()),
        "mean_abs": float(diff.mean()),
        "max_rel_to_range": float(diff.max() / (b.max() - b.min())),
        "argmax_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
    }


def quantized_names(export_dir: Path) -> list[str]:
    """Linears that carry ``qweight`` in the checkpoint (FORMAT.md: quantized iff qweight exists)."""
    from safetensors import safe_open

    names = []
    for f in sorted(export_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            names += [k[: -len(".qweight")] for k in st.keys() if k.endswith(".qweight")]
    return sorted(names)


def main() -> None:
    args = parse_args()
    import torch

    torch.set_num_threads(args.threads)
    import gptqmodel
    from gptqmodel import BACKEND, GPTQModel

    from quantize.dequant import load_dequantized

    export_dir = args.export_dir.resolve()
    qc = json.loads((export_dir / "config.json").read_text())["quantization_config"]
    method = qc["quant_method"]
    backend = args.backend or BACKENDS[method]
    out = args.out or ROOT / "benchmarks" / "results" / f"peer_load-{method}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        peer = GPTQModel.load(
            str(export_dir), device="cpu", backend=BACKEND(backend), dtype=torch.bfloat16
        ).model.eval()
    except Exception as exc:  # a refusal is a result: record it, then fail
        report = {
            "export_dir": str(export_dir),
            "quant_method": method,
            "library": f"gptqmodel {gptqmodel.__version__}",
            "backend": backend,
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
        }
        out.write_text(json.dumps(report, indent=2))
        print(f"gptqmodel could not load {export_dir}: {report['error']}")
        sys.exit(1)
    load_seconds = time.perf_counter() - start
    ref16 = load_dequantized(export_dir, torch.bfloat16)
    ref32 = load_dequantized(export_dir, torch.float32)
    ids = token_rows(export_dir, args.rows, args.tokens)
    with torch.no_grad():
        logits = {
            name: m(input_ids=ids).logits for name, m in (("peer", peer), ("ref_bf16", ref16), ("ref_fp32", ref32))
        }
    weights = compare_weights(peer, ref32, grid_steps(export_dir, quantized_names(export_dir), qc))
    report = {
        "export_dir": str(export_dir),
        "quant_method": method,
        "bits": qc["bits"],
        "group_size": qc["group_size"],
        "library": f"gptqmodel {gptqmodel.__version__}",
        "backend": backend,
        "torch": torch.__version__,
        "load_seconds": load_seconds,
        "weights": weights,
        "logits_vs_ref_bf16": compare_logits(logits["peer"], logits["ref_bf16"]),
        "logits_vs_ref_fp32": compare_logits(logits["peer"], logits["ref_fp32"]),
        "ref_bf16_vs_ref_fp32": compare_logits(logits["ref_bf16"], logits["ref_fp32"]),
        "rows": args.rows,
        "tokens": args.tokens,
    }
    bf16_budget = args.bf16_factor * report["ref_bf16_vs_ref_fp32"]["max_abs"] + 1e-3
    ok = weights["max_steps"] <= args.max_steps and report["logits_vs_ref_fp32"]["max_abs"] <= bf16_budget
    report["ok"] = ok
    out.write_text(json.dumps(report, indent=2))
    print(f"{report['library']} ({backend}) loaded {export_dir} [{method}, {qc['bits']}-bit, group {qc['group_size']}]")
    print(
        f"  weights: {weights['linears']} linears via {weights['kernels']}: max |dW| = "
        f"{weights['max_steps']:.3f} grid steps,"
        f" {weights['max_rel']:.2e} of max |W|"
        f" (worst {weights['worst']})"
    )
    for key in ("logits_vs_ref_bf16", "logits_vs_ref_fp32", "ref_bf16_vs_ref_fp32"):
        c = report[key]
        print(
            f"  {key}: max |d| {c['max_abs']:.4f} ({c['max_rel_to_range']:.2e} of range), mean {c['mean_abs']:.4f},"
            f" argmax agreement {c['argmax_agree']:.2%}"
        )
    print(f"  {'OK' if ok else 'FAILED'}; wrote {out}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
