"""Partition a tiny model with ZeRO-3, then initialise new rows through ``embed.initialise``.

Launched by the slow test with ``torchrun --nproc_per_node 2 zero3_init_worker.py WORK``;
rank 0 compares the gathered result with the same initialisation on an unpartitioned copy.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch


def main() -> None:
    from warsha import runtime

    runtime.apply()  # allocator and threads before the first tensor
    import deepspeed
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from tokenizer_ext import ds_train, embed

    work = Path(sys.argv[1])
    ds_train.init_distributed()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    model.resize_token_embeddings(320, mean_resizing=False)
    reference = copy.deepcopy(model)
    sources = [[i % 200, (7 * i) % 200] for i in range(40)]
    embed.initialise(reference, 256, sources, "subword_mean", seed=0)
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    weight = engine.module.get_input_embeddings().weight
    partitioned = weight.numel() == 0 and hasattr(weight, "ds_id")
    embed.initialise(engine.module, 256, sources, "subword_mean", seed=0)
    state = engine._zero3_consolidated_16bit_state_dict()
    if dist.get_rank() == 0:
        ref = reference.state_dict()
        diff = max(
            float((state[k].float() - ref[k].float()).abs().max())
            for k in ("model.embed_tokens.weight", "lm_head.weight")
        )
        out = {"world_size": dist.get_world_size(), "partitioned": partitioned, "max_abs_diff": diff}
        (work / "result.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
