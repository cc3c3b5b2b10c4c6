"""Stage registry of the ``distill`` package: ``distill.draft``.

Imports only dataclasses, typing and light core modules: the runner imports this file to
validate a recipe in well under a second; torch and transformers load inside ``run``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from warsha.schema import check, ge, gt, le
from warsha.stage import StageDef
from warsha.training import TrainParams

if TYPE_CHECKING:
    from warsha.widths import Widths


@dataclass
class DraftParams:
    """How the draft is built, distilled and measured."""

    method: Literal["layers", "config", "model"] = field(
        default="layers",
        metadata=check(help="keep target layers | smaller config | start from draft_path"),
    )
    layers: list[int] = field(
        default_factory=lambda: [0], metadata=check(help="method=layers: target layer indices to keep")
    )
    hidden_size: int = field(default=128, metadata=check(ge(8), help="method=config"))
    intermediate_size: int = field(default=352, metadata=check(ge(8), help="method=config"))
    num_layers: int = field(default=1, metadata=check(ge(1), help="method=config"))
    num_heads: int = field(default=4, metadata=check(ge(1), help="method=config"))
    num_kv_heads: int = field(default=2, metadata=check(ge(1), help="method=config"))
    init: Literal["random", "embedding"] = field(
        default="embedding",
        metadata=check(help="method=config: random, or copy/project the target's embedding and head"),
    )
    draft_path: str | None = field(default=None, metadata=check(help="method=model: an HF draft directory"))
    loss: Literal["fkl", "rkl", "tvd", "jsd"] = "fkl"
    temperature: float = field(default=1.0, metadata=check(gt(0.0), help="distillation temperature"))
    on_policy_fraction: float = field(
        default=0.5, metadata=check(ge(0.0), le(1.0), help="share of steps on sampled continuations")
    )
    on_policy_source: Literal["draft", "target", "mixed"] = "draft"
    prompt_len: int = field(default=16, metadata=check(ge(1), help="corpus prompt tokens for on-policy samples"))
    gen_len: int = field(default=48, metadata=check(ge(1), help="sampled tokens per on-policy sequence"))
    gen_temperature: float = field(default=1.0, metadata=check(ge(0.0)))
    teacher_cache_topk: int = field(
        default=0, metadata=check(ge(0), help="0: teacher on the fly; k: cache its top-k log-probs per chunk")
    )
    baseline: bool = field(default=True, metadata=check(help="also train the no-teacher baseline"))
    draft_vocab_size: int = field(
        default=0,
        metadata=check(
            ge(0),
            help="write draft_vocab.json with the N most frequent training tokens;"
            " the serve engine then computes draft logits for those only (0: off)",
        ),
    )
    distill_vocab: Literal["full", "draft"] = field(
        default="full",
        metadata=check(
            help="full: match the teacher over the whole vocabulary; draft: over the draft_vocab_size"
            " ids serve proposes from (teacher renormalised over them), with the embedding and head"
            " frozen, so a large-vocabulary target's head stops dominating each step; on-policy"
            " samples are then drawn among those ids too"
        ),
    )
    max_train_documents: int = field(default=4000, metadata=check(ge(1), help="train documents per language"))
    eval_documents: int = field(default=64, metadata=check(ge(1), help="validation documents per language"))
    eval_len: int = field(default=128, metadata=check(ge(2), help="tokens per held-out sequence"))
    spec_prompts: int = field(default=4, metadata=check(ge(1), help="validation prompts per speculative run"))
    spec_prompt_len: int = field(default=16, metadata=check(ge(1)))
    spec_new_tokens: int = field(default=48, metadata=check(ge(1)))
    spec_ks: list[int] = field(default_factory=lambda: list(range(1, 9)))
    spec_temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    decode_threads: int = field(
        default=1, metadata=check(ge(0), help="intra-op threads for batch-1 measurements (0: leave as is)")
    )
    train: TrainParams = field(
        default_factory=lambda: TrainParams(
            steps=200, batch_size=8, seq_len=128, lr=1e-3, warmup_steps=20, checkpoint_every=50
        )
    )

    def validate(self) -> list[str]:
        """Cross-field checks that need no model (layer indices are checked against the
        target at the start of ``run``, before any work)."""
        problems = []
        if self.method == "layers" and not self.layers:
            problems.append("layers: method 'layers' needs at least one layer index")
        if self.method == "config":
            if self.hidden_size % self.num_heads:
                problems.append(f"num_heads: must divide hidden_size {self.hidden_size}, got {self.num_heads}")
            elif self.num_heads % self.num_kv_heads:
                problems.append(f"num_kv_heads: must divide num_heads {self.num_heads}, got {self.num_kv_heads}")
        if self.method == "model":
            if not self.draft_path:
                problems.append("draft_path: method 'model' needs an HF draft directory")
            elif not (Path(self.draft_path) / "config.json").is_file():
                problems.append(f"draft_path: no config.json in {self.draft_path!r}")
        if self.distill_vocab == "draft":
            if not self.draft_vocab_size:
                problems.append("distill_vocab: 'draft' needs draft_vocab_size > 0 (the ids to distil over)")
            if self.teacher_cache_topk:
                problems.append(
                    "teacher_cache_topk: the top-k cache holds full-vocabulary log-probs; set 0"
                    " with distill_vocab 'draft'"
                )
        if any(k < 1 for k in self.spec_ks):
            problems.append(f"spec_ks: every k must be >= 1, got {self.spec_ks}")
        if any(t < 0 for t in self.spec_temperatures):
            problems.append(f"spec_temperatures: must be >= 0, got {self.spec_temperatures}")
        return problems


def widths(p: DraftParams, target: "Widths | None") -> "Widths | None":
    """The draft's widths at planning (``warsha.widths``): the target's with fewer layers, the
    configured ones in the target's family, or the given draft's ``config.json``."""

    from warsha.widths import from_model_dir, from_sizes

    if p.method == "model":
        return from_model_dir(Path(p.draft_path)) if p.draft_path else None
    if target is None:
        return None
    if p.method == "layers":
        return target.with_layers(len(p.layers), "draft of the target's layers")
    return from_sizes(target.model_type, p, "draft config params")


STAGES: dict[str, StageDef] = {
    "draft": StageDef(
        name="distill.draft",
        params=DraftParams,
        entry="distill.run:run",
        description="build a draft with the target's tokenizer, distil it, measure acceptance",
        training=True,
        widths="distill.stages:widths",
    )
}
