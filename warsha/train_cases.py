"""Each stage's training step on fixed shapes: its model, batch shape and loss.

``python -m benchmarks.train_bench`` and ``python -m benchmarks.lm_loss_bench`` time these steps
(``warsha.train_overhead``). This is the one core module that reaches into the stage packages
(it builds each stage's model the way the stage does); only ``warsha.train_overhead`` imports
it, and nothing imports that, so no cycle follows (tests/test_layout.py).

Each case mirrors what the demo recipe (``recipes/arabic-tiny.yaml``) trains, on random weights
and random token ids (throughput does not depend on what the tokens say):

- ``bootstrap``: the 4-layer, hidden-256 Llama on a 32k vocabulary, 8 x 256 tokens, full training;
- ``adapt``: the same model extended to 48k rows, NF4 through bitsandbytes with LoRA r16 on every
  linear layer and the 16k new embedding/head rows trainable (peft), 8 x 256 tokens;
- ``yarn``: the extended model with YaRN x4 (1,024 positions), full training on 2 x 1,024 tokens
  with half the targets scored through the LM head (the stage's ``lm_positions: 0.5``);
- ``distill``: a 1-layer hidden-128 draft learning the extended model's distribution (forward KL,
  teacher forward on the fly), 8 x 128 tokens. On-policy steps, which also sample from the draft,
  are left out: they measure generation, not the training step.

``CASES[name](args)`` returns a ``Case``; ``make_model()`` is called once per loop, so both loops
start from identical weights.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BASE_VOCAB = 32000
EXTENDED_VOCAB = 48000


@dataclass
class Case:
    """One stage's training step: fresh identical models, per-step batches, the loss."""

    make_model: Callable[[], Any]
    batch_fn: Callable[[int, int, int], dict[str, Any]]
    loss_fn: Callable[[Any, dict[str, Any]], Any]
    batch_size: int
    seq_len: int
    lr: float


def _llama_config(vocab: int, positions: int = 256) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=positions, tie_word_embeddings=False,
    )  # fmt: skip


def _seeded_model(config: Any) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.float32)


def _token_batches(steps: int, batch_size: int, seq_len: int, vocab: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (batch_size, seq_len), generator=g) for _ in range(steps + 1)]


def _causal_lm_case(make_model: Callable[[], Any], vocab: int, args: argparse.Namespace) -> Case:
    """8 x 256-token rows scored at every position, as the bootstrap and adapt stages train."""
    from warsha.training import causal_lm_loss

    batches = _token_batches(args.steps, 8, 256, vocab)
    return Case(
        make_model=make_model,
        batch_fn=lambda step, micro, rank: {"input_ids": batches[step]},
        loss_fn=causal_lm_loss,
        batch_size=8,
        seq_len=256,
        lr=2e-3,
    )


def bootstrap(args: argparse.Namespace) -> Case:
    """Full training of the bootstrap model on its 32k vocabulary."""
    return _causal_lm_case(lambda: _seeded_model(_llama_config(BASE_VOCAB)), BASE_VOCAB, args)


def adapt(args: argparse.Namespace) -> Case:
    """QLoRA on the extended model: NF4 base, LoRA r16 everywhere, the new rows trainable."""
    from tokenizer_ext import qlora

    model_dir = Path(tempfile.mkdtemp(prefix="train-bench-adapt-"))
    atexit.register(shutil.rmtree, model_dir, ignore_errors=True)  # the saved base is only this run's
    _seeded_model(_llama_config(EXTENDED_VOCAB)).save_pretrained(model_dir)
    new_ids = list(range(BASE_VOCAB, EXTENDED_VOCAB))
    return _causal_lm_case(
        lambda: qlora.load(model_dir, new_ids, False, 16, 32, 0.0, True, False, bf16=False, seed=0),
        EXTENDED_VOCAB,
        args,
    )


def yarn(args: argparse.Namespace) -> Case:
    """Full fine-tune of the YaRN x4 model on 1,024-token rows, half the targets scored."""
    import torch
    from transformers import LlamaConfig

    from context_ext import scaling
    from warsha.lm_loss import weighted_lm_loss

    cfg = scaling.scaled_config(_llama_config(EXTENDED_VOCAB).to_dict(), "yarn", 4.0)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k != scaling.RECORD_KEY})
    ids = _token_batches(args.steps, 2, 1024, EXTENDED_VOCAB)
    g = torch.Generator().manual_seed(2)
    weights = [(torch.rand(2, 1024, generator=g) < 0.5).float() for _ in ids]
    return Case(
        make_model=lambda: _seeded_model(config),
        batch_fn=lambda step, micro, rank: {"input_ids": ids[step], "loss_weights": weights[step]},
        loss_fn=weighted_lm_loss,
        batch_size=2,
        seq_len=1024,
        lr=2e-4,
    )


def distill(args: argparse.Namespace) -> Case:
    """Forward-KL distillation of a 1-layer hidden-128 draft from the extended model."""
    import torch

    from distill import draft
    from distill.train import DistillSpec, distill_loss

    teacher = _seeded_model(_llama_config(EXTENDED_VOCAB)).eval()
    ids = _token_batches(args.steps, 8, 128, EXTENDED_VOCAB)
    mask = torch.ones(8, 128, dtype=torch.bool)  # off-policy rows train every position
    return Case(
        make_model=lambda: draft.from_config(teacher, 128, 352, 1, 4, 2, "embedding"),
        batch_fn=lambda step, micro, rank: {"input_ids": ids[step], "mask": mask},
        loss_fn=distill_loss(teacher, DistillSpec(loss="fkl")),
        batch_size=8,
        seq_len=128,
        lr=2e-3,
    )


CASES: dict[str, Callable[[argparse.Namespace], Case]] = {
    "bootstrap": bootstrap,
    "adapt": adapt,
    "yarn": yarn,
    "distill": distill,
}
