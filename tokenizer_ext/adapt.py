"""Stage ``tokenizer_ext.adapt``: teach the extended model its new pieces, and prove it paid off.

Two runs with the same budget (steps x sequences x tokens) over the same documents: the
extended model on the extended tokenizer, and (``compare_base``) the base model on the base
tokenizer. Bits per character on held-out text compares them across tokenizers; the target is
"extended <= base adapted the same way" for Arabic, and English within 5% of the base model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizer_ext import chat_quality, embed, mix, quality
from warsha.precision import compute_dtype

if TYPE_CHECKING:
    from tokenizer_ext.replay import Replay
    from tokenizer_ext.stages import AdaptParams
    from warsha.stage import StageContext


def run(ctx: "StageContext", p: "AdaptParams") -> dict[str, Any]:
    """Adapt the extended model (and the base control), measure, write the merged model."""
    side = embed.read_sidecar(ctx.model_dir, "tokenizer_ext.adapt")
    base_dir = base_model_dir(ctx, side) if p.compare_base else None
    if p.deepspeed:
        from tokenizer_ext import ds_train

        ds_train.load_config(p.deepspeed, p.train, 1, p.offload_optimizer)  # fail before any work
    rows = _rows(ctx.model_dir)
    if p.mode == "qlora" and rows % 32:
        raise ValueError(
            f"{ctx.model_dir}: {rows} vocabulary rows is not a multiple of 32, which bitsandbytes"
            " 4-bit rejects; rerun tokenizer_ext.embed with pad_to_multiple_of: 64"
        )
    texts = training_texts(ctx.corpus(), p, ctx.seed)
    new_ids = list(range(int(side["base_vocab_size"]), _tokenizer_size(ctx.model_dir)))
    sets = quality.domain_texts(p.domain_eval, p.domain_docs, ctx.corpus())
    metrics: dict[str, Any] = {"mode": p.mode, "train_docs": len(texts), "deepspeed": p.deepspeed}
    rep = _replay(ctx, p, side, metrics) if p.replay_fraction else None
    domain_nll: dict[str, dict[str, list[float]]] = {}
    metrics["extended"] = adapt_one(ctx, p, ctx.model_dir, ctx.model_dir, new_ids, "extended", ctx.out_dir, sets, rep)
    if base_dir is not None:
        tok_dir = ctx.model_dir / "base_tokenizer"
        metrics["base_same_budget"] = adapt_one(ctx, p, base_dir, tok_dir, [], "base", None, sets, rep)
        if ctx.is_main:
            metrics["base_model"] = _base_scores(ctx, p, base_dir, tok_dir, sets)
            metrics["targets"] = targets(metrics)
            if "chat" in metrics["base_model"]:
                metrics["chat_targets"] = chat_targets(metrics)
    for name in ("extended", "base_same_budget", "base_model"):
        if name in metrics and DOMAIN_NLL in metrics[name]:
            domain_nll[name] = metrics[name].pop(DOMAIN_NLL)
    if domain_nll and ctx.is_main:
        reference = "base_model" if "base_model" in domain_nll else "extended"
        metrics["other_domains"] = quality.domain_report(domain_nll, sets, reference=reference)
    if ctx.is_main:
        side_out = {**side, "adapted": p.mode}
        embed.carry_tokenizer(ctx.model_dir, ctx.out_dir, side_out)
    return metrics


DOMAIN_NLL = "_domain_nll"
"""Key under which each model's per-document other-domain NLLs travel until the report pairs them."""


REPLAY = "replay_"
"""Prefix of a batch's replay tensors (``Replay.batch`` keys), beside the corpus ``input_ids``."""


def replay_rows(p: "AdaptParams") -> int:
    """Replay sequences per micro-batch: ``replay_fraction`` of ``batch_size``, the rest corpus."""
    return round(p.train.batch_size * p.replay_fraction) if p.replay_fraction else 0


def replay_loss(p: "AdaptParams", corpus_loss: Any = None, text_loss: Any = None) -> Any:
    """The training loss: ``corpus_loss`` on the corpus windows (the next-token loss unless a
    distillation loss is given), plus ``replay_weight`` times the cross-entropy against the base's
    distributions on the replay sequences (``text_loss`` when they are read as text, the stored
    distributions otherwise), each weighted by its share of the batch (so without replay this is
    ``corpus_loss`` alone)."""
    from warsha.lm_loss import causal_lm_loss, soft_lm_loss

    corpus_loss = corpus_loss or causal_lm_loss
    replay_part = text_loss or soft_lm_loss
    n_rep = replay_rows(p)
    share = n_rep / p.train.batch_size

    def loss_fn(model: Any, batch: dict[str, Any]) -> Any:
        loss = corpus_loss(model, {k: v for k, v in batch.items() if not k.startswith(REPLAY)})
        if not n_rep:
            return loss
        soft = replay_part(model, {k[len(REPLAY) :]: v for k, v in batch.items() if k.startswith(REPLAY)})
        return (1 - share) * loss + share * p.replay_weight * soft

    return loss_fn


def _replay(ctx: "StageContext", p: "AdaptParams", side: dict[str, Any], metrics: dict[str, Any]) -> "Replay":
    """The base-written replay set, generated once per stage run (kept beside its checkpoints, so
    a resumed run trains on the same sequences); languages alternate target / source."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenizer_ext.replay import Replay, generate

    path = ctx.checkpoint_dir / "replay.pt"
    t0 = time.perf_counter()
    if path.is_file():
        rep = Replay.load(path)
    else:
        cfg = ctx.corpus().config
        n = p.train.steps * p.train.grad_accum * ctx.world_size * replay_rows(p)
        langs = [cfg.target_lang if i % 2 == 0 else cfg.source_lang for i in range(n)]
        model = AutoModelForCausalLM.from_pretrained(base_model_dir(ctx, side), dtype=torch.float32)
        model = model.to(compute_dtype(p.train.bf16, "auto"))
        tok = AutoTokenizer.from_pretrained(ctx.model_dir / "base_tokenizer")
        rep = generate(model, tok, langs, p.train.seq_len, p.replay_top_k, ctx.seed)
        if ctx.is_main:
            rep.save(path)
    metrics["replay"] = {
        "sequences": len(rep.langs),
        "tokens": int(rep.ids.numel()),
        "languages": {lang: rep.langs.count(lang) for lang in sorted(set(rep.langs))},
        "seconds": time.perf_counter() - t0,
    }
    return rep


def base_model_dir(ctx: "StageContext", side: dict[str, Any]) -> Path:
    """The unextended model: the ``base`` input if the recipe maps one, else what extend read."""
    found = ctx.inputs.get("base") or (Path(side["base_model"]) if side.get("base_model") else None)
    if found is None or not (Path(found) / "config.json").is_file():
        raise ValueError(
            "compare_base: the base model is not available (no 'base' input and no base_model"
            f" recorded by extend at {found}); map the base artifact or set compare_base: false"
        )
    return Path(found)


def training_texts(corpus: Any, p: "AdaptParams", seed: int) -> list[str]:
    """The adapt runs' documents: ``mix.mixed_texts`` with the stage's source share and cap."""
    return mix.mixed_texts(corpus, p.source_fraction, seed, p.train_docs)


def adapt_one(
    ctx: "StageContext",
    p: "AdaptParams",
    weights: Path,
    tok_dir: Path,
    new_ids: list[int],
    name: str,
    out: Path | None,
    sets: dict[str, list[str]],
    rep: "Replay | None" = None,
) -> dict[str, Any]:
    """Train one model with the shared budget; evaluate and (if ``out``) save it on rank 0.

    With ``rep``, each batch holds ``replay_rows`` base-written sequences beside the corpus
    windows, trained against the base's own distributions (``replay_loss``)."""
    from transformers import AutoTokenizer

    from warsha.training import eval_point, pack_documents, random_windows

    tok = AutoTokenizer.from_pretrained(tok_dir)
    corpus = ctx.corpus()
    texts = training_texts(corpus, p, ctx.seed)
    stream = pack_documents(tok, texts)
    t = p.train
    n_rep = replay_rows(p)
    windows = _distill_windows(ctx, p, tok, texts) if p.distill_weight else None
    as_text = _replay_windows(ctx, p, tok, rep) if rep is not None and p.replay_as_text else None

    def batch_fn(step: int, micro: int, rank: int) -> dict[str, Any]:
        key = f"{ctx.seed}/{step}/{micro}/{rank}"
        if windows is not None:
            batch = windows(t.batch_size - n_rep, key)
        else:
            batch = {"input_ids": random_windows(stream, t.batch_size - n_rep, t.seq_len, ctx.seed, step, micro, rank)}
        if as_text is not None:
            batch.update({REPLAY + k: v for k, v in as_text(n_rep, f"{key}/replay").items()})
        elif rep is not None:
            first = ((step * t.grad_accum + micro) * ctx.world_size + rank) * n_rep
            rows = [(first + j) % len(rep.ids) for j in range(n_rep)]
            batch.update({REPLAY + k: v for k, v in rep.batch(rows).items()})
        return batch

    def scores(model: Any, set_eval: bool = False) -> tuple[dict[str, float], dict[str, list[float]]]:
        bpc = quality.bits_per_char(model, tok, corpus, p.eval_docs, p.eval_max_length, set_eval=set_eval)
        return bpc, quality.document_nll(model, tok, sets, p.eval_max_length, set_eval=set_eval)

    def eval_fn(model: Any) -> dict[str, float]:
        bpc, nll = scores(model)
        return {**bpc, **quality.domain_bpc(nll, sets)}

    loss = _loss(ctx, p, new_ids, rep is not None)
    model, result, extra = _train(TrainJob(ctx, p, weights, new_ids, name, batch_fn, out, eval_fn, loss))
    step = max(1, len(result.losses) // 50)
    metrics: dict[str, Any] = {
        **result.summary(),
        **extra,
        "stream_tokens": int(len(stream)),
        "loss_curve": result.losses[::step],
        "bits_per_char_curve": result.evals,
    }
    if model is None:
        return metrics
    metrics["bits_per_char"], nll = scores(model, set_eval=True)
    if t.eval_every and (not result.evals or result.evals[-1]["step"] != t.steps):
        # the loop left its last point to this scoring (Trainer.final_eval: the same weights);
        # QLoRA's loop scores its NF4 model, which the merge into float32 replaces, so it keeps it
        end = {**metrics["bits_per_char"], **quality.domain_bpc(nll, sets)}
        result.evals.append(eval_point(ctx, f"adapt_{name}", t.steps, end))
    metrics["script_leak"] = quality.script_leak(model, tok, corpus, p.eval_docs, p.eval_max_length)
    if sets:
        metrics[DOMAIN_NLL] = nll
    if out is not None:
        model.save_pretrained(out)
    if p.gen_tokens:
        model = model.to(compute_dtype(None, "auto"))
        metrics["generation"] = quality.generation_speed(model, tok, quality.prompts(corpus), p.gen_tokens)
    metrics.update(chat_scores(model, tok, corpus, p))
    return metrics


def _replay_windows(ctx: "StageContext", p: "AdaptParams", tok: Any, rep: "Replay") -> Any:
    """``_distill_windows`` over the replay sequences as text (``replay_as_text``)."""
    from transformers import AutoTokenizer

    base_tok = AutoTokenizer.from_pretrained(ctx.model_dir / "base_tokenizer")
    return _distill_windows(ctx, p, tok, rep.texts(base_tok))


def _distill_windows(ctx: "StageContext", p: "AdaptParams", tok: Any, texts: list[str]) -> Any:
    """``(n, key) -> batch`` of corpus windows under ``tok`` and the base tokenizer, aligned for
    the cross-tokenizer distillation term (``cross_tok``)."""
    from transformers import AutoTokenizer

    from tokenizer_ext import cross_tok

    base_tok = AutoTokenizer.from_pretrained(ctx.model_dir / "base_tokenizer")
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def make(n: int, key: str) -> dict[str, Any]:
        return cross_tok.collate(cross_tok.sample_windows(texts, n, tok, base_tok, p.train.seq_len, key), pad)

    return make


def _loss(ctx: "StageContext", p: "AdaptParams", new_ids: list[int], replay: bool) -> Any:
    """``replay_loss`` with the cross-tokenizer terms the options ask for, sharing one teacher."""
    text_replay = replay and p.replay_as_text
    if not (p.distill_weight or text_replay):
        return replay_loss(p)
    term = _cross_tok_term(ctx, new_ids)
    corpus = term(p.distill_top_k, p.distill_weight, 1.0) if p.distill_weight else None
    return replay_loss(p, corpus, term(p.replay_top_k, 1.0, 0.0) if text_replay else None)


def _cross_tok_term(ctx: "StageContext", new_ids: list[int]) -> Any:
    """``(k, distill_weight, nll_weight) -> loss``: the cross-tokenizer term against the frozen
    unextended base (``cross_tok.loss_fn``). The same-budget base run (no new ids) gets the same
    term, its tokens then aligning one to one: both runs are held to the base alike."""
    import torch
    from transformers import AutoModelForCausalLM

    from tokenizer_ext import cross_tok

    side = embed.read_sidecar(ctx.model_dir, "tokenizer_ext.adapt")
    teacher = AutoModelForCausalLM.from_pretrained(base_model_dir(ctx, side), dtype=torch.float32)
    base_n = int(side["base_vocab_size"])
    sources = embed.base_splits(ctx.model_dir, base_n, base_n + len(new_ids)) if new_ids else []
    firsts = cross_tok.first_pieces(sources)

    def make(k: int, distill_weight: float, nll_weight: float) -> Any:
        return cross_tok.loss_fn(teacher, firsts, base_n, k, distill_weight, nll_weight)

    return make


@dataclass
class TrainJob:
    """One adapt training run (the extended model or the same-budget base), as both modes take it.

    ``eval_fn`` gives the held-out curve when ``train.eval_every`` is set (not under DeepSpeed,
    whose partitioned parameters cannot be evaluated on one rank); ``out`` is None on the
    same-budget base run, whose merged model is not kept.
    """

    ctx: StageContext
    p: AdaptParams
    weights: Path
    new_ids: list[int]
    name: str
    batch_fn: Any
    out: Path | None
    eval_fn: Any
    loss_fn: Any


def _train(job: TrainJob) -> tuple[Any, Any, dict[str, Any]]:
    """Dispatch on the mode; returns (plain model on rank 0 or None, TrainResult, info)."""
    if job.p.mode == "qlora":
        return _train_qlora(job)
    import torch
    from transformers import AutoModelForCausalLM

    ctx, p, weights, name = job.ctx, job.p, job.weights, job.name

    model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    trainable = _select(model, p.mode)
    info = {"trainable_params": sum(q.numel() for q in trainable)}
    if p.deepspeed:
        from tokenizer_ext import ds_train

        cfg = ds_train.load_config(p.deepspeed, p.train, ds_train.world_size(), p.offload_optimizer)
        result, state = ds_train.train(model, p.train, ctx, job.batch_fn, cfg, f"adapt_{name}")
        info.update(zero_stage=ds_train.zero_stage(cfg), world_size=ds_train.world_size())
        if state is None:
            return None, result, info
        return _from_state(weights, state), result, info
    from warsha.training import Trainer

    trainer = Trainer(
        model=model,
        p=p.train,
        ctx=ctx,
        batch_fn=job.batch_fn,
        loss_fn=job.loss_fn,
        name=f"adapt_{name}",
        parameters=trainable,
        eval_fn=job.eval_fn,
        final_eval=False,  # the trained weights are the final model's: adapt_one scores them once
    )
    result = trainer.run()
    return (trainer.model.float() if ctx.is_main else None), result, info


def _from_state(weights: Path, state: dict[str, Any]) -> Any:
    """A fresh fp32 model holding the trained weights (ZeRO-3 left the original partitioned)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"DeepSpeed state does not fit the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model


def _train_qlora(job: TrainJob) -> tuple[Any, Any, dict[str, Any]]:
    from transformers import AutoConfig

    from tokenizer_ext import qlora
    from warsha.training import Trainer

    ctx, p, weights, new_ids, name = job.ctx, job.p, job.weights, job.new_ids, job.name
    tied = bool(getattr(AutoConfig.from_pretrained(weights), "tie_word_embeddings", False))
    model = qlora.load(
        weights,
        new_ids,
        tied,
        p.lora_r,
        p.lora_alpha,
        p.lora_dropout,
        p.double_quant,
        p.full_embeddings,
        bf16=p.train.bf16,
        seed=ctx.seed,
        layers=p.lora_layers,
        quantize=p.quantize_base,
    )
    trainable, total = qlora.trainable_count(model)
    trainer = Trainer(
        model=model,
        p=p.train,
        ctx=ctx,
        batch_fn=job.batch_fn,
        loss_fn=job.loss_fn,
        name=f"adapt_{name}",
        eval_fn=job.eval_fn,
        on_optimizer=_slow_base_rows(model, p, new_ids),
    )
    result = trainer.run()
    info = {"trainable_params": trainable, "total_params": total, "trainable_new_rows": len(new_ids)}
    if not ctx.is_main:
        return None, result, info
    adapter_dir = job.out / "adapter" if job.out is not None else ctx.checkpoint_dir / f"adapter_{name}"
    return qlora.save_and_merge(trainer.model, weights, adapter_dir), result, info


def _slow_base_rows(model: Any, p: "AdaptParams", new_ids: list[int]) -> Any:
    """The optimizer hook that moves the base vocabulary's rows at ``base_rows_lr_scale`` and the
    new rows at ``new_rows_lr_scale`` times the learning rate (None when every row takes the
    full rate). Without new ids (the same-budget base run) every row is a base row, so both runs
    treat the base vocabulary alike."""
    if not p.full_embeddings or (p.base_rows_lr_scale == 1.0 and p.new_rows_lr_scale == 1.0):
        return None
    from tokenizer_ext import qlora, row_lr

    weights = qlora.trained_embeddings(model)
    first_new = min(new_ids) if new_ids else weights[0].shape[0]

    def hook(opt: Any) -> None:
        for weight in weights:
            if p.base_rows_lr_scale != 1.0:
                row_lr.scale_rows(opt, weight, 0, first_new, p.base_rows_lr_scale)
            if p.new_rows_lr_scale != 1.0:
                row_lr.scale_rows(opt, weight, first_new, None, p.new_rows_lr_scale)

    return hook


def _select(model: Any, mode: str) -> list[Any]:
    """Parameters to train: all of them (full) or the embedding and LM head (embeddings)."""
    if mode == "full":
        return [q for q in model.parameters() if q.requires_grad]
    keep = {id(model.get_input_embeddings().weight)}
    head = model.get_output_embeddings()
    if head is not None:
        keep.add(id(head.weight))
    for q in model.parameters():
        q.requires_grad_(id(q) in keep)
    return [q for q in model.parameters() if q.requires_grad]


def _base_scores(
    ctx: "StageContext", p: "AdaptParams", base_dir: Path, tok_dir: Path, sets: dict[str, list[str]]
) -> dict[str, Any]:
    """The unadapted base model on its own tokenizer: the reference English must stay near."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    corpus = ctx.corpus()
    out: dict[str, Any] = {
        "bits_per_char": quality.bits_per_char(model, tok, corpus, p.eval_docs, p.eval_max_length),
        "script_leak": quality.script_leak(model, tok, corpus, p.eval_docs, p.eval_max_length),
    }
    if sets:
        out[DOMAIN_NLL] = quality.document_nll(model, tok, sets, p.eval_max_length)
    if p.gen_tokens:
        out["generation"] = quality.generation_speed(
            model.to(compute_dtype(None, "auto")), tok, quality.prompts(corpus), p.gen_tokens
        )
    out.update(chat_scores(model, tok, corpus, p))
    return out


def chat_scores(model: Any, tok: Any, corpus: Any, p: "AdaptParams") -> dict[str, Any]:
    """``{"chat": ...}`` for a model whose tokenizer has a chat template (``chat_quality``), else
    nothing: a base model without one has no chat behaviour to keep."""
    if not p.chat_tokens or not getattr(tok, "chat_template", None):
        return {}
    langs = (corpus.config.target_lang, corpus.config.source_lang)
    return {"chat": chat_quality.evaluate(model, tok, langs, p.chat_tokens)}


def chat_targets(m: dict[str, Any]) -> dict[str, Any]:
    """The extended model's and the same-budget base's chat answers against the base model's."""
    base = m["base_model"]["chat"]
    names = [n for n in ("extended", "base_same_budget") if "chat" in m[n]]
    return {name: chat_quality.compare(base, m[name]["chat"]) for name in names}


def targets(m: dict[str, Any]) -> dict[str, Any]:
    """The adaptation's acceptance figures from the measured numbers: the extended model against
    the base trained on the same budget (target language), and each language's bits per
    character against the unadapted base. Getting better is never a miss: the checks are "at
    most 5% worse", not "within 5% either way"."""
    ext, ctl, base = (m[k]["bits_per_char"] for k in ("extended", "base_same_budget", "base_model"))
    langs = list(ext)
    out: dict[str, Any] = {f"{langs[0]}_bpc_extended_le_base_adapted": ext[langs[0]] <= ctl[langs[0]]}
    for lang in langs:
        change = ext[lang] / base[lang] - 1.0
        out[f"{lang}_bpc_change_vs_base_model"] = change
        out[f"{lang}_bpc_at_most_5pct_worse"] = change <= 0.05
    return out


def _rows(model_dir: Path) -> int:
    import json

    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def _tokenizer_size(model_dir: Path) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(model_dir))
