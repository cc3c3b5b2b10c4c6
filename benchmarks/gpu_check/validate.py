"""Part `validate`: serve.validate's measurement, plain engine against engine plus draft.

The stage's own pieces (`warsha.serve_validate.run_interleaved` and `compare_outputs`) on a
seeded target and its layer-skip draft, on the device: greedy outputs of the two engines must
agree (near-tie flips named), and the acceptance rate and speedup are reported. On CUDA the
target is a 4-layer Llama with damped later layers (so a 1-layer draft agrees often) in bf16,
batch sizes 1 and 8; on CPU the same in float32 with the torch backend, batch size 4.
"""

from __future__ import annotations

import argparse

from benchmarks.gpu_check.common import PartResult, part_main


def run(result: PartResult, args: argparse.Namespace) -> None:
    import torch

    from serve import LLM
    from serve.config import ModelConfig
    from warsha.engine_check import Workload, prompts
    from warsha.random_models import make_layer_skip_draft, make_model
    from warsha.serve_validate import compare_outputs, run_interleaved

    cuda = result.device == "cuda"
    target = args.workdir / "target"
    if not (target / "config.json").is_file():
        make_model(target, seed=3, num_hidden_layers=4, hidden_size=256, intermediate_size=512,
                   num_attention_heads=8, num_key_value_heads=2, _damp_layers_from=1)  # fmt: skip
    draft = make_layer_skip_draft(target, args.workdir / "draft", num_layers=1)
    dtype = "bfloat16" if cuda else "float32"
    common = dict(device=result.device, dtype=dtype, num_kv_blocks=512, block_size=16)
    vocab = ModelConfig.from_dir(target).vocab_size
    ps = prompts(Workload(num_prompts=4 if args.quick else 8, shared_prefix=0, suffix=4), vocab, seed=5)
    tolerance = 0.01 if dtype == "float32" else 0.0625
    for bs in ((1, 8) if cuda else (4,))[: 1 if args.quick else None]:
        engines = [LLM(target, max_num_seqs=bs, **common),
                   LLM(target, draft, max_num_seqs=bs, num_speculative_tokens=4, **common)]  # fmt: skip
        outs, stats = run_interleaved(engines, ps, bs, 16 if args.quick else 32)
        verdict = compare_outputs(engines[0], ps, outs[0], outs[1], tolerance)
        real = verdict["mismatched_requests"] - verdict["near_tie_flips"]
        spec = stats[1]
        result.add(f"serve.validate batch {bs}, {dtype}: draft output = plain output", real == 0 and
                   (spec.get("acceptance_rate") or 0) > 0, **verdict, acceptance_rate=spec.get("acceptance_rate"),
                   speedup=round(spec["output_tokens_per_s"] / stats[0]["output_tokens_per_s"], 3))  # fmt: skip
        del engines
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    part_main("validate", run)
