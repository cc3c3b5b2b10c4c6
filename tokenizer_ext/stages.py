"""Stages of ``tokenizer_ext``: extend the vocabulary, initialise embeddings, adapt.

Imported by the recipe validator: only dataclasses, typing and the core's schema here; the
heavy work lives in sibling modules imported inside each ``run``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from warsha import domains
from warsha.schema import check, ge, gt, le
from warsha.stage import StageDef
from warsha.training import TrainParams


@dataclass
class ExtendParams:
    """``tokenizer_ext.extend``: how many pieces to learn and how to keep them safe."""

    vocab_size: int = field(
        default=48000,
        metadata=check(ge(2), help="total ids after extension (base + added); must exceed the base's"),
    )
    train_vocab_size: int | None = field(
        default=None, metadata=check(ge(2), help="size of the target-language BPE (default: pieces to add)")
    )
    character_coverage: float = field(default=0.9995, metadata=check(gt(0.0), le(1.0)))
    max_train_chars: int = field(
        default=0, metadata=check(ge(0), help="cap on training characters, seeded sample (0 = all)")
    )
    script: str = field(
        default="auto",
        metadata=check(help="added pieces must contain this script: auto (by language), none, or a regex class"),
    )
    letters_only: bool = field(
        default=False,
        metadata=check(
            help="added pieces are words or parts of words (letters, marks, a leading space): none with"
            " punctuation, digits or bidi marks glued on (docs/adaptation.md, 'Which pieces')"
        ),
    )
    prune_unreachable: bool = field(default=True, metadata=check(help="drop added pieces nothing produces"))
    check_docs: int = field(default=0, metadata=check(ge(0), help="held-out docs per check (0 = all)"))


@dataclass
class DomainEval:
    """Held-out text from other domains than the training corpus (``warsha.domains``), scored
    for every model a stage compares: forgetting shows there, not on the training corpus."""

    domain_eval: list[str] = field(
        default_factory=lambda: list(domains.DOMAINS),
        metadata=check(help=f"other-domain sets to score ({', '.join(domains.DOMAINS)}; [] = skip)"),
    )
    domain_docs: int = field(default=16, metadata=check(ge(1), help="documents per other-domain set"))

    def validate(self) -> list[str]:
        """Every set is known and its package installed."""
        return domains.problems(self.domain_eval, "domain_eval")


def share_problems(name: str, fraction: float, batch_size: int) -> list[str]:
    """A share of each batch given to replayed text must be at least one sequence and leave
    one for the corpus."""
    n = round(batch_size * fraction)
    if fraction and n == 0:
        return [f"{name}: {fraction} of batch_size {batch_size} is no sequence; raise it or the batch size"]
    if fraction and n >= batch_size:
        return [f"{name}: leaves no corpus sequence in a batch; lower it or raise batch_size"]
    return []


@dataclass
class EmbedParams(DomainEval):
    """``tokenizer_ext.embed``: resize, initialise and measure the untrained extension."""

    init: Literal["subword_mean", "random", "mean_all"] = field(
        default="subword_mean",
        metadata=check(help="new rows: mean of the base pieces' rows, random, or mean of all rows"),
    )
    init_scale: float = field(
        default=1.0,
        metadata=check(gt(0.0), le(2.0), help="multiplies the new rows (docs/adaptation.md: 0.6-0.8 scored better)"),
    )
    pad_to_multiple_of: int = field(
        default=64, metadata=check(ge(1), help="pad rows to a multiple (bitsandbytes 4-bit needs 32)")
    )
    untie: bool = field(
        default=False,
        metadata=check(
            help="give a tied model its own output matrix (a copy), so a new piece's input and output rows"
            " can differ; the head's bytes are stored twice"
        ),
    )
    eval_docs: int = field(default=64, metadata=check(ge(0), help="held-out docs for bits per char (0 = skip)"))
    eval_max_length: int = field(default=256, metadata=check(ge(8)))
    fit: TrainParams = field(
        default_factory=lambda: TrainParams(steps=0, batch_size=4, seq_len=256, lr=1e-3, warmup_steps=2),
        metadata=check(
            help="fit the new rows alone to the base before saving (steps: 0 = off; tokenizer_ext.fit_rows)"
        ),
    )
    fit_map: bool = field(
        default=False,
        metadata=check(
            help="fit: train one linear map from a piece's subword rows (mean, first, last) to its row, shared"
            " by every new piece, instead of each row on its own: rare pieces learn from frequent ones"
            " (tokenizer_ext.row_map; docs/adaptation.md)"
        ),
    )
    fit_distill_weight: float = field(
        default=1.0,
        metadata=check(ge(0.0), help="fit: weight of the cross-tokenizer term against the base (0 = next-token only)"),
    )
    fit_nll_weight: float = field(
        default=1.0, metadata=check(ge(0.0), help="fit: weight of the next-token loss on the extended tokens")
    )
    fit_map_reads: list[int] = field(
        default_factory=list,
        metadata=check(
            help="fit_map: the base's hidden states (indices: 0 the embeddings, -1 the final one) after reading"
            " [BOS] + a piece's split join the map's features, e.g. [6, -1] (tokenizer_ext.row_map.read_features)"
        ),
    )
    fit_map_read_scale: float = field(
        default=10.0,
        metadata=check(
            gt(0.0), help="fit_map_reads: each block's mean norm in base rows' norms (its rate relative to the map's)"
        ),
    )
    fit_chain_weight: float = field(
        default=0.0,
        metadata=check(
            ge(0.0),
            help="fit: weight of the chain-rule teacher's second level: how the base splits its next token's"
            " mass among the new pieces starting with it, taught to every such piece (tokenizer_ext.chain_teacher)",
        ),
    )
    fit_top_k: int = field(default=32, metadata=check(ge(1), help="fit: base tokens kept per aligned position"))
    fit_source_fraction: float = field(
        default=0.25, metadata=check(ge(0.0), le(0.9), help="fit: share of source-language documents in the text")
    )
    fit_replay_fraction: float = field(
        default=0.0,
        metadata=check(
            ge(0.0),
            le(0.9),
            help="fit: share of each batch's windows cut from target-language text the base writes itself"
            " (the new rows meet contexts outside the corpus; docs/adaptation.md)",
        ),
    )
    fit_replay_docs: int = field(
        default=32, metadata=check(ge(1), help="fit: base-written documents (fit.seq_len base tokens each)")
    )

    def validate(self) -> list[str]:
        """The other-domain sets, and a replay share that is a whole number of windows."""
        problems = share_problems("fit_replay_fraction", self.fit_replay_fraction, self.fit.batch_size)
        if self.fit_map_reads and not self.fit_map:
            problems.append("fit_map_reads: the reads are features of the map; set fit_map: true (or drop them)")
        return super().validate() + problems


@dataclass
class AdaptParams(DomainEval):
    """``tokenizer_ext.adapt``: teach the model its new pieces (QLoRA or full/embeddings)."""

    mode: Literal["qlora", "full", "embeddings"] = "qlora"
    train: TrainParams = field(default_factory=lambda: TrainParams(lr=2e-4))
    lora_r: int = field(default=16, metadata=check(ge(1)))
    lora_alpha: int = field(default=32, metadata=check(ge(1)))
    lora_dropout: float = field(default=0.0, metadata=check(ge(0.0), le(0.9)))
    double_quant: bool = field(default=True, metadata=check(help="NF4 double quantization of the scales"))
    quantize_base: bool = field(
        default=True,
        metadata=check(
            help="qlora: the frozen base in NF4 (QLoRA); false: LoRA on the unquantized base, the weights the"
            " adapter is merged into (more memory; no NF4 offset merged into them: docs/adaptation.md)"
        ),
    )
    full_embeddings: bool = field(
        default=False, metadata=check(help="qlora: train whole embedding and LM head instead of the new rows")
    )
    base_rows_lr_scale: float = field(
        default=1.0,
        metadata=check(
            ge(0.0),
            le(1.0),
            help="full_embeddings: learning-rate multiplier for the base vocabulary's rows (new rows take lr)",
        ),
    )
    new_rows_lr_scale: float = field(
        default=1.0,
        metadata=check(
            ge(0.0),
            le(1.0),
            help="full_embeddings: learning-rate multiplier for the new rows (and padding); LoRA keeps lr",
        ),
    )
    deepspeed: str | None = field(
        default=None, metadata=check(help="DeepSpeed JSON (recipes/deepspeed/*.json) for full/embeddings")
    )
    offload_optimizer: bool = field(default=False, metadata=check(help="DeepSpeed: optimizer state on CPU"))
    compare_base: bool = field(
        default=True, metadata=check(help="also adapt the base model on its own tokenizer with the same budget")
    )
    train_docs: int = field(default=0, metadata=check(ge(0), help="cap on training documents (0 = all)"))
    source_fraction: float = field(
        default=0.5, metadata=check(ge(0.0), le(1.0), help="share of source-language text mixed in (keeps English)")
    )
    eval_docs: int = field(default=64, metadata=check(ge(1)))
    eval_max_length: int = field(default=256, metadata=check(ge(8)))
    gen_tokens: int = field(default=64, metadata=check(ge(0), help="greedy tokens per prompt for chars/s (0 = skip)"))
    replay_fraction: float = field(
        default=0.0,
        metadata=check(
            ge(0.0),
            le(0.9),
            help="share of each batch's sequences written by the base, trained on the base's own distributions",
        ),
    )
    replay_weight: float = field(default=1.0, metadata=check(gt(0.0), help="weight of the replay (distillation) loss"))
    replay_top_k: int = field(default=32, metadata=check(ge(1), help="teacher tokens kept per replay position"))
    replay_as_text: bool = field(
        default=False,
        metadata=check(
            help="each model reads the replay as text through its own tokenizer (the extended one uses its"
            " new pieces there) and is held to the base by the cross-tokenizer term; off: both read the"
            " base's ids, where no new piece ever comes next"
        ),
    )
    distill_weight: float = field(
        default=0.0,
        metadata=check(
            ge(0.0),
            help="weight of the cross-tokenizer distillation term against the frozen base on the corpus"
            " windows (tokenizer_ext.cross_tok; 0 = off); the same-budget base gets the same term",
        ),
    )
    distill_top_k: int = field(default=32, metadata=check(ge(1), help="base tokens kept per aligned position"))
    lora_layers: list[int] | None = field(
        default=None, metadata=check(help="qlora: decoder layers that get LoRA (null = all; e.g. first and last two)")
    )
    chat_tokens: int = field(
        default=64,
        metadata=check(
            ge(0), help="instruct base: greedy answer tokens per chat question (tokenizer_ext.chat_quality; 0 = skip)"
        ),
    )

    def validate(self) -> list[str]:
        """Options that only make sense in some modes."""
        problems = super().validate()
        if self.mode == "qlora" and self.deepspeed:
            problems.append("deepspeed: QLoRA runs without DeepSpeed here; use mode full or embeddings")
        if self.offload_optimizer and not self.deepspeed:
            problems.append("offload_optimizer: needs a deepspeed config")
        if self.full_embeddings and self.mode != "qlora":
            problems.append("full_embeddings: only for mode qlora (full/embeddings train whole matrices)")
        if self.distill_weight and self.deepspeed:
            problems.append("distill_weight: the distillation term runs in the Trainer, not under DeepSpeed yet")
        if self.replay_fraction and self.deepspeed:
            problems.append("replay_fraction: the replay loss runs in the Trainer, not under DeepSpeed yet")
        problems += share_problems("replay_fraction", self.replay_fraction, self.train.batch_size)
        if self.replay_as_text and not self.replay_fraction:
            problems.append("replay_as_text: there is no replay to read; set replay_fraction (e.g. 0.25)")
        if self.lora_layers is not None and (self.mode != "qlora" or not self.lora_layers):
            problems.append("lora_layers: a non-empty list of layer indices, for mode qlora only")
        if self.base_rows_lr_scale != 1.0 and not self.full_embeddings:
            problems.append("base_rows_lr_scale: needs full_embeddings: true (otherwise base rows are frozen)")
        if self.new_rows_lr_scale != 1.0 and not self.full_embeddings:
            problems.append("new_rows_lr_scale: needs full_embeddings: true (row scales act on the whole matrix)")
        return problems


STAGES: dict[str, StageDef] = {
    "extend": StageDef(
        name="tokenizer_ext.extend",
        params=ExtendParams,
        entry="tokenizer_ext.extend:run",
        description="train target-language BPE pieces and append them to the base tokenizer",
    ),
    "embed": StageDef(
        name="tokenizer_ext.embed",
        params=EmbedParams,
        entry="tokenizer_ext.embed:run",
        description="resize embeddings and LM head; initialise new rows, optionally fit them to the base",
    ),
    "adapt": StageDef(
        name="tokenizer_ext.adapt",
        params=AdaptParams,
        entry="tokenizer_ext.adapt:run",
        description="adaptation fine-tune (QLoRA, or full/embeddings under DeepSpeed ZeRO)",
        optional_inputs=("base",),  # the unextended model for compare_base; hashed when mapped
        training=True,
    ),
}
