"""The ``distill.draft`` stage: build, distil, compare with the no-teacher baseline, measure.

Order matters for cost: every check that can refuse the job (layer indices, vocabulary, sizes)
runs on configs and tokenizers before a weight is loaded or a step is trained.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distill import draft as drafting
from distill import draft_vocab
from distill.train import DistillSpec, TopkCache, baseline_batches, distill_batches, distill_loss, train_or_load
from warsha.precision import compute_dtype

if TYPE_CHECKING:
    from distill.stages import DraftParams
    from warsha.stage import StageContext


def preflight(p: "DraftParams", target_dir: Path) -> None:
    """Refuse a bad job before any work: missing layers, a foreign vocabulary, lengths."""
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(target_dir)
    if p.method == "layers":
        drafting.check_layers(p.layers, cfg.num_hidden_layers)
    if p.method == "config" and p.init == "embedding" and p.hidden_size > cfg.hidden_size:
        raise ValueError(
            f"hidden_size: {p.hidden_size} is wider than the target's {cfg.hidden_size}, so its"
            " embedding cannot be copied; use init: random or a smaller hidden_size"
        )
    if p.method == "model":
        dcfg = AutoConfig.from_pretrained(p.draft_path)
        drafting.assert_same_vocab(
            AutoTokenizer.from_pretrained(target_dir), AutoTokenizer.from_pretrained(p.draft_path), cfg, dcfg
        )
    limit = cfg.max_position_embeddings
    for name, n in (
        ("train.seq_len", p.train.seq_len),
        ("prompt_len + gen_len", p.prompt_len + p.gen_len),
        ("eval_len", p.eval_len),
        ("spec_prompt_len + spec_new_tokens + 8", p.spec_prompt_len + p.spec_new_tokens + max(p.spec_ks)),
    ):
        if n > limit:
            raise ValueError(f"{name}: {n} exceeds the target's max_position_embeddings {limit}")


def build_draft(p: "DraftParams", target: Any, ctx: "StageContext") -> Any:
    """The initial draft by the chosen method; warns (and records) when it is not smaller."""
    from transformers import AutoModelForCausalLM

    if p.method == "layers":
        draft = drafting.layer_subset(target, p.layers)
    elif p.method == "config":
        draft = drafting.from_config(
            target, p.hidden_size, p.intermediate_size, p.num_layers, p.num_heads, p.num_kv_heads, p.init, seed=ctx.seed
        )
    else:
        draft = AutoModelForCausalLM.from_pretrained(p.draft_path, dtype=target.dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drafting.warn_if_larger(draft, target)
    for w in caught:
        ctx.log.warning("distill.draft: %s", w.message)
        warnings.warn(w.message, UserWarning, stacklevel=2)
    return draft


def texts_by_language(ctx: "StageContext", split: str, per_lang: int) -> dict[str, list[str]]:
    """Up to ``per_lang`` documents of each language from one split (target language first)."""
    corpus = ctx.corpus()
    langs = (corpus.config.target_lang, corpus.config.source_lang)
    return {lang: list(corpus.texts(lang, split)[:per_lang]) for lang in langs}  # type: ignore[arg-type]


def load_texts(ctx: "StageContext", split: str, per_lang: int) -> list[str]:
    """``texts_by_language`` as one list, target language first."""
    return [t for texts in texts_by_language(ctx, split, per_lang).values() for t in texts]


def run(ctx: "StageContext", p: "DraftParams") -> dict[str, Any]:
    """Build the draft, distil it (and the baseline), measure, write the draft directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distill.data import build_pools, encode_docs

    preflight(p, ctx.model_dir)
    torch.manual_seed(ctx.seed)
    tokenizer = AutoTokenizer.from_pretrained(ctx.model_dir)
    target = AutoModelForCausalLM.from_pretrained(ctx.model_dir, dtype=torch.float32).eval()
    init = build_draft(p, target, ctx).float()
    teacher = copy.deepcopy(target).to(compute_dtype(None, "auto")).eval().requires_grad_(False)

    train_docs = encode_docs(tokenizer, load_texts(ctx, "train", p.max_train_documents))
    pools = build_pools(train_docs, p.train.seq_len, p.prompt_len, ctx.seed)
    held_out_by_lang = texts_by_language(ctx, "validation", p.eval_documents)
    held_out_texts = [t for texts in held_out_by_lang.values() for t in texts]

    spec = DistillSpec(
        p.loss,
        p.temperature,
        p.on_policy_fraction,
        p.on_policy_source,
        p.prompt_len,
        p.gen_len,
        p.gen_temperature,
        p.teacher_cache_topk,
    )
    cache = TopkCache(p.teacher_cache_topk, target.config.vocab_size) if p.teacher_cache_topk else None
    vocab_ids: list[int] = []
    vocab_info: dict[str, Any] = {}
    if p.draft_vocab_size:
        vocab_ids, vocab_info = _draft_vocab(ctx, p, tokenizer, train_docs, held_out_texts)
    student = copy.deepcopy(init).train()
    if p.distill_vocab == "draft":
        draft_vocab.restrict_head(student, vocab_ids)
        draft_vocab.restrict_head(teacher, vocab_ids)
    columns = torch.tensor(vocab_ids) if p.distill_vocab == "draft" else None
    batch_fn = distill_batches(student, teacher, pools, spec, p.train.batch_size, ctx.seed, cache, columns)
    distilled, d_summary = train_or_load(ctx, "distill", student, p.train, batch_fn, distill_loss(teacher, spec))
    if p.distill_vocab == "draft":
        distilled = draft_vocab.with_full_head(distilled, init)
    models = {"init": init, "distilled": distilled.float().eval()}
    train_summary = {"distill": d_summary, "chunks": int(pools.chunks.shape[0])}
    if cache is not None:
        train_summary["teacher_cache_hits"] = cache.hits
    if p.baseline:
        base, b_summary = train_or_load(
            ctx, "baseline", copy.deepcopy(init).train(), p.train, baseline_batches(pools, p.train.batch_size, ctx.seed)
        )
        models["baseline"] = base.float().eval()
        train_summary["baseline"] = b_summary
    del teacher

    from distill.report import measure

    served = vocab_ids if p.distill_vocab == "draft" else []
    metrics = measure(ctx, p, target, models, tokenizer, held_out_by_lang, served)
    metrics["train"] = train_summary
    metrics["draft"] = describe(init, target, p)
    if vocab_ids:
        metrics["draft_vocab"] = vocab_info
    if ctx.is_main:
        drafting.save_draft(distilled, ctx.model_dir, ctx.out_dir)
        if vocab_ids:
            draft_vocab.write(Path(ctx.out_dir), vocab_ids, metrics["draft_vocab"])
        (Path(ctx.out_dir) / "acceptance.json").write_text(json.dumps(metrics, indent=2))
        from distill.report import write_report

        write_report(metrics, Path(ctx.out_dir))
    return metrics


def _draft_vocab(
    ctx: "StageContext", p: "DraftParams", tokenizer: Any, train_docs: list[list[int]], held_out_texts: list[str]
) -> tuple[list[int], dict[str, Any]]:
    """The frequent-token subset for serving, and how much held-out text it covers."""
    from distill.data import encode_docs

    ids = draft_vocab.frequent_tokens(train_docs, p.draft_vocab_size, tokenizer.all_special_ids)
    held_out = encode_docs(tokenizer, held_out_texts)
    info = {"size": len(ids), "held_out_coverage": draft_vocab.coverage(held_out, ids)}
    ctx.log.info(
        "distill.draft: draft vocabulary of %d ids covers %.1f%% of held-out tokens",
        len(ids),
        100 * info["held_out_coverage"],
    )
    return ids, info


def describe(init: Any, target: Any, p: "DraftParams") -> dict[str, Any]:
    """Sizes of draft and target, the parts that the embedding and head account for."""

    def non_embedding(m: Any) -> int:
        emb = m.get_input_embeddings().weight.numel()
        head = 0 if m.config.tie_word_embeddings else m.get_output_embeddings().weight.numel()
        return drafting.param_count(m) - emb - head

    return {
        "method": p.method,
        "layers": p.layers if p.method == "layers" else None,
        "num_hidden_layers": init.config.num_hidden_layers,
        "hidden_size": init.config.hidden_size,
        "parameters": drafting.param_count(init),
        "non_embedding_parameters": non_embedding(init),
        "target_parameters": drafting.param_count(target),
        "target_non_embedding_parameters": non_embedding(target),
        "vocab_size": init.config.vocab_size,
        "rope_parameters": getattr(init.config, "rope_parameters", None),
    }
