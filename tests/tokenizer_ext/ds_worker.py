"""Run ``tokenizer_ext.adapt`` (mode full) under DeepSpeed in one of several processes.

Launched by the slow test through ``torchrun --nproc_per_node 2``:
``ds_worker.py MODEL_DIR WORK_DIR CONFIG.json``. Rank 0 writes ``result.json`` with the world
size, the losses and a parameter fingerprint per rank (``fingerprint-<rank>.json``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

from tokenizer_ext import adapt, ds_train
from tokenizer_ext.stages import AdaptParams
from warsha.data import DataConfig, load_corpus
from warsha.stage import StageContext
from warsha.training import TrainParams


class _Tracker:
    def log(self, metrics: dict, step: int | None = None) -> None:
        pass


def main() -> None:
    from warsha import runtime

    runtime.apply()  # allocator and threads before the first tensor
    model_dir, work, config = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    rank = int(os.environ.get("RANK", "0"))
    corpus = load_corpus(DataConfig(max_documents=400))
    recipe = SimpleNamespace(data=corpus.config, seed=0)
    ctx = StageContext(
        stage="tokenizer_ext.adapt",
        stage_id="adapt",
        recipe=recipe,
        out_dir=work / "out",
        inputs={"model": model_dir},
        input_manifests={},
        checkpoint_dir=work / "ckpt",
        tracker=_Tracker(),
        device="cpu",
        seed=0,
        is_main=rank == 0,
        world_size=ds_train.world_size(),
        _corpus=corpus,
    )
    train = TrainParams(steps=6, batch_size=2, seq_len=32, lr=3e-3, warmup_steps=1, checkpoint_every=3, log_every=1)
    p = AdaptParams(
        mode="full",
        domain_eval=[],
        train=train,
        deepspeed=config,
        compare_base=False,
        eval_docs=2,
        eval_max_length=32,
        gen_tokens=0,
        train_docs=100,
    )
    metrics = adapt.run(ctx, p)
    if rank == 0:
        (work / "result.json").write_text(json.dumps(metrics))


if __name__ == "__main__":
    main()
