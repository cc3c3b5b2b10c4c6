"""Write a function-preserving copy of a model on which 4-bit rounding is costly, as on real LLMs.

Why: AWQ and GPTQ exist because rounding real LLMs' weights to 4 bits costs measurable quality
(Llama-2-7B at g128: RTN +4.8% perplexity), largely through a few channels far larger than the
rest: activation outliers (Dettmers et al. 2022) and weight outliers ("super weights", Yu et al.
2024) that stretch their groups' integer grids. The bootstrap models trained here have neither:
their 4-bit RTN error is about +0.05%, the size of evaluation noise, so no method can be told
from another on them. This script gives a model that regime without changing what it computes:
for each decoder layer and each chosen channel ``c`` it moves a factor ``m`` between the RMSNorm
weight and column ``c`` of every linear that norm feeds (q/k/v, gate/up).

- ``--kind weight`` (default): norm / m, columns * m. The columns become their groups' largest
  weights, so every other weight of those groups gets an m-times coarser grid; the activations
  meeting them shrink by m, which is what activation-aware scaling can undo.
- ``--kind activation``: norm * m, columns / m. The activations become outliers; rounding can
  lose no more than those channels' own contribution, so RTN suffers far less.

The float model's logits are unchanged (``tests/quantize/test_outliers.py`` checks it in
float64). The same channels are used in every layer, as real outlier features sit in fixed
hidden dimensions. On the 350-step bootstrap, ``--magnitude 10`` gives RTN +3% on English, the
anchor's regime; x4 gives +0.3% and x20 +57%.

Example (the README's quantize rows on the outlier stand-in)::

    .venv/bin/python -m benchmarks.outlier_standin --model runs/arabic-tiny/bootstrap \
        --out runs/bootstrap-w10 --magnitude 10
    .venv/bin/python -m benchmarks.quant_bench --model runs/bootstrap-w10 --methods rtn,rtn-asym,awq,gptq
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from quantize.outliers import inject_outliers, pick_channels


def main() -> None:
    """Load, inject, save (model, tokenizer files and a record of what was done)."""
    from warsha import runtime

    runtime.apply(reexec=True)  # allocator and threads before the first tensor
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="HF model directory (Llama family)")
    p.add_argument("--out", type=Path, required=True, help="where to write the stand-in (must not exist)")
    p.add_argument("--channels", type=int, default=4, help="outlier channels per layer (same ones in every layer)")
    p.add_argument("--magnitude", type=float, default=10.0, help="the factor moved between norm and weights")
    p.add_argument(
        "--kind",
        choices=("weight", "activation"),
        default="weight",
        help="weight: the fed columns grow (their groups' grids coarsen); activation: the norm's channels grow",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.out.exists():
        raise SystemExit(f"--out {args.out} exists; choose a new directory (nothing was written)")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    channels = pick_channels(model.config.hidden_size, args.channels, args.seed)
    inject_outliers(model, channels, args.magnitude, args.kind)
    tmp = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in args.model.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(f, tmp / f.name)
    record = {"source": str(args.model.resolve()), "channels": channels, "magnitude": args.magnitude, "kind": args.kind}
    (tmp / "outlier_standin.json").write_text(json.dumps(record, indent=2) + "\n")
    tmp.rename(args.out)
    print(f"wrote {args.out}: {args.kind} outliers x{args.magnitude:g} on channels {channels} in every layer")


if __name__ == "__main__":
    main()
