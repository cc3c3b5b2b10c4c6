"""Stage ``context_ext.yarn``: extend a RoPE model's context, fine-tune it long, prove both ends.

Imports only the schema here (the runner imports this module to validate recipes); the work
is in ``context_ext.yarn_stage``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from warsha.schema import check, ge, gt, le
from warsha.stage import StageDef

Method = Literal["yarn", "linear", "ntk"]
Baseline = Literal["none", "linear", "ntk", "yarn"]


@dataclass
class YarnParams:
    """Scaling, fine-tune budget and evaluation grid of the context extension."""

    method: Method = field(default="yarn", metadata=check(help="yarn (NTK-by-parts), linear (PI) or ntk"))
    factor: float = field(default=4.0, metadata=check(gt(1.0), help="context multiplier s (> 1)"))
    original_max_position_embeddings: int | None = field(
        default=None, metadata=check(ge(16), help="pre-extension context; default: the model config's")
    )
    target_length: int | None = field(
        default=None, metadata=check(ge(16), help="fine-tune sequence length; default original * factor")
    )
    compose: bool = field(default=False, metadata=check(help="multiply into an existing scaling of the same method"))
    ntk_dynamic: bool = field(default=False, metadata=check(help="ntk only: dynamic instead of static"))
    beta_fast: float | None = field(default=None, metadata=check(gt(0.0), help="yarn ramp start (32)"))
    beta_slow: float | None = field(default=None, metadata=check(gt(0.0), help="yarn ramp end (1)"))
    attention_factor: float | None = field(default=None, metadata=check(gt(0.0), help="yarn: override 0.1 ln s + 1"))
    # fine-tune
    steps: int = field(default=200, metadata=check(ge(0), le(1000), help="fine-tune optimizer steps"))
    batch_size: int = field(default=4, metadata=check(ge(1)))
    grad_accum: int = field(default=1, metadata=check(ge(1)))
    lr: float = field(default=5e-4, metadata=check(gt(0.0)))
    warmup_steps: int = field(default=20, metadata=check(ge(0)))
    checkpoint_every: int = field(default=50, metadata=check(ge(1)))
    bf16: bool | None = field(default=None, metadata=check(help="bf16 autocast; null: where it is fast"))
    train_head: bool = field(
        default=True,
        metadata=check(
            help="false freezes an untied LM head: faster steps on a small model (docs/results.md; its weight"
            " gradient is a third of the head's cost), but a base that still learns from any training"
            " loses what the head would have learnt"
        ),
    )
    retrieval_fraction: float = field(
        default=0.5, metadata=check(ge(0.0), le(1.0), help="share of training sequences that are passkey samples")
    )
    answer_weight: float = field(default=5.0, metadata=check(gt(0.0), help="loss weight of passkey answer tokens"))
    copy_fraction: float = field(
        default=0.0, metadata=check(ge(0.0), le(1.0), help="share of rows that repeat a filler span (copy targets)")
    )
    curriculum: float = field(
        default=0.0,
        metadata=check(ge(0.0), le(1.0), help="share of steps spent ramping row length up from the original"),
    )
    lm_positions: float = field(
        default=1.0, metadata=check(gt(0.0), le(1.0), help="share of corpus-row targets scored (saves LM-head time)")
    )
    source_fraction: float = field(
        default=0.0,
        metadata=check(
            ge(0.0),
            le(0.9),
            help="share of corpus tokens from the corpus's other language, so the fine-tune does not erase it",
        ),
    )
    finetune_baselines: list[Method] = field(
        default_factory=lambda: ["linear"], metadata=check(help="also fine-tune these with the same budget")
    )
    # evaluation
    baselines: list[Baseline] = field(
        default_factory=lambda: ["none", "linear", "ntk", "yarn"], metadata=check(help="evaluated without fine-tuning")
    )
    eval_multiples: list[float] = field(default_factory=lambda: [1.0, 2.0, 4.0, 8.0])
    short_multiples: list[float] = field(default_factory=lambda: [0.5, 1.0])
    depths: list[float] = field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])
    min_trials: int = field(default=40, metadata=check(ge(1), help="passkey trials per length, at least"))
    max_trials: int = field(default=400, metadata=check(ge(1)))
    ci_half_width: float = field(default=0.05, metadata=check(gt(0.0), help="stop when the 95% CI is this narrow"))
    ppl_documents: int = field(default=2, metadata=check(ge(1)))
    short_eval_tokens: int = field(
        default=8192,
        metadata=check(
            ge(1), help="held-out tokens of the other language scored at the short lengths (its regression check)"
        ),
    )
    eval_batch_tokens: int = field(default=4096, metadata=check(ge(16), help="tokens per eval forward pass"))
    eval_dtype: Literal["auto", "bfloat16", "float32"] = field(
        default="auto", metadata=check(help="auto: bfloat16 where the device has fast bf16, else float32")
    )
    lang: str | None = field(default=None, metadata=check(help="text language; default the corpus target"))

    def validate(self) -> list[str]:
        """Cross-field checks (the config-dependent ones run before any weights load)."""
        problems = []
        if self.original_max_position_embeddings and self.target_length:
            if self.original_max_position_embeddings > self.target_length:
                problems.append(
                    f"target_length: must be >= original_max_position_embeddings"
                    f" {self.original_max_position_embeddings}, got {self.target_length}"
                )
        if self.retrieval_fraction + self.copy_fraction > 1.0:
            problems.append(
                f"copy_fraction: retrieval_fraction + copy_fraction must be <= 1, got"
                f" {self.retrieval_fraction} + {self.copy_fraction}"
            )
        if self.min_trials > self.max_trials:
            problems.append(f"min_trials: must be <= max_trials {self.max_trials}, got {self.min_trials}")
        if any(not 0.0 < d < 1.0 for d in self.depths):
            problems.append(f"depths: each must be in (0, 1), got {self.depths}")
        if any(m <= 0 for m in self.eval_multiples + self.short_multiples):
            problems.append("eval_multiples/short_multiples: must be > 0")
        if any(m > 1 for m in self.short_multiples):
            problems.append(
                f"short_multiples: must be <= 1 (at or below the original length), got {self.short_multiples}"
            )
        if self.method in self.finetune_baselines:
            problems.append(f"finetune_baselines: {self.method!r} is the main method; list only the others")
        if self.ntk_dynamic and self.method != "ntk" and "ntk" not in self.baselines:
            problems.append("ntk_dynamic: only applies when method or a baseline is ntk")
        return problems


STAGES = {
    "yarn": StageDef(
        name="context_ext.yarn",
        params=YarnParams,
        entry="context_ext.yarn_stage:run",
        description="RoPE context extension (YaRN; PI and NTK baselines), long fine-tune, passkey + perplexity",
        training=True,
    )
}
