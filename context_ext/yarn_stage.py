"""The ``context_ext.yarn`` run: check, scale, fine-tune, evaluate every method, write the model.

Order of work, chosen so that a mistake costs seconds and a killed run costs little:
1. read config.json and resolve the plan (no RoPE, scaled twice, original > target all fail
   here, before any weights load);
2. evaluate the unscaled model and each scaling without fine-tuning;
3. fine-tune the chosen method (resumable; the finished weights are kept in the checkpoint
   directory), write it as the stage's model, and check the written config by recomputing
   the frequencies transformers derives from it;
4. fine-tune the baselines with the same batches and budget, evaluate, write table and plot.
Each finished evaluation is cached in the checkpoint directory, so a resumed run skips it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from context_ext import longdata, report, scaling, suite
from context_ext.passkey import PasskeyFormat, filler_stream
from warsha import tokenizer_files
from warsha.artifacts import fsync_tree, write_json_atomic

if TYPE_CHECKING:
    from context_ext.stages import YarnParams
    from warsha.stage import StageContext


@dataclass
class Plan:
    """Resolved lengths and configs (everything that can be wrong about the input, checked)."""

    base_cfg: dict[str, Any]
    factor: float
    original: int
    target: int
    lengths: list[int]
    short_lengths: list[int]
    configs: dict[str, dict[str, Any]]
    skipped: dict[str, str]


def resolve(base_cfg: dict[str, Any], p: "YarnParams") -> Plan:
    """Validate the model config against the params; ``ValueError`` naming field and fix."""
    state = scaling.read_state(base_cfg)
    factor, original = scaling.plan(state, p.method, p.factor, p.original_max_position_embeddings, p.compose)
    target = p.target_length or int(round(original * factor))
    if original > target:
        raise ValueError(
            f"target_length: must be >= the original context {original}, got {target}; raise"
            " target_length or set original_max_position_embeddings"
        )
    yarn_opts = {"beta_fast": p.beta_fast, "beta_slow": p.beta_slow, "attention_factor": p.attention_factor}
    configs: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for method in dict.fromkeys([p.method, *p.baselines, *p.finetune_baselines]):
        try:
            configs[method] = suite.variant_config(
                base_cfg,
                method,
                p.factor,
                p.original_max_position_embeddings,
                p.compose,
                p.ntk_dynamic,
                yarn_opts,
            )
        except ValueError as exc:
            if method == p.method:
                raise
            skipped[method] = str(exc)
    lengths = [int(round(original * m)) for m in p.eval_multiples]
    short = [int(round(original * m)) for m in p.short_multiples]
    return Plan(base_cfg, factor, original, target, lengths, short, configs, skipped)


def _cached(path: Path, compute: Any) -> dict[str, Any]:
    if path.is_file():
        return json.loads(path.read_text())
    value = compute()
    write_json_atomic(path, value)  # a kill mid-write must not leave a truncated cache entry
    return value


def eval_data(
    tokenizer: Any,
    corpus: Any,
    lang: str,
    plan: Plan,
    n_docs: int,
    source_lang: str | None = None,
    source_tokens: int = 8192,
) -> suite.EvalData:
    """Held-out filler and perplexity documents (validation + test splits only).

    ``source_lang``: also at least ``source_tokens`` tokens of held-out text of the corpus's
    other language, for the short-context check there (a fine-tune on one language can silently
    cost the other); a few hundred tokens would leave that ratio to chance.
    """
    texts = longdata.heldout_texts(corpus, lang)
    half = len(texts) // 2
    filler = filler_stream(tokenizer, texts[:half] or texts)
    ppl = longdata.long_documents(tokenizer, texts[half:] or texts, n_docs, 2 * max(plan.lengths))
    source: list[str] = []
    if source_lang and source_lang != lang:
        need = max(source_tokens, 2 * max(plan.short_lengths))
        try:
            source = longdata.long_documents(tokenizer, longdata.heldout_texts(corpus, source_lang), 1, need)
        except ValueError as err:
            raise ValueError(
                f"short_eval_tokens: the {source_lang} held-out text has fewer than {need} tokens;"
                " lower short_eval_tokens or add validation/test text"
            ) from err
    return suite.EvalData(PasskeyFormat(tokenizer), filler, ppl, source)


def finetune(ctx: "StageContext", p: "YarnParams", plan: Plan, method: str, batches: Any) -> tuple[Any, dict[str, Any]]:
    """Fine-tune ``method``'s scaled model; reuse the finished weights of an earlier run."""
    import torch

    from warsha.lm_loss import weighted_lm_loss
    from warsha.training import Trainer, TrainParams

    done = ctx.checkpoint_dir / f"final-{method}"
    if (done / "summary.json").is_file():
        model = suite.load_variant(done, plan.configs[method], "float32")
        return model, json.loads((done / "summary.json").read_text())
    model = suite.load_variant(ctx.model_dir, plan.configs[method], "float32").train()
    if not p.train_head and freeze_head(model):
        ctx.log.info("yarn fine-tune of %s: LM head frozen (train_head: false)", method)
    tp = TrainParams(
        steps=p.steps,
        batch_size=p.batch_size,
        seq_len=plan.target,
        lr=p.lr,
        warmup_steps=p.warmup_steps,
        grad_accum=p.grad_accum,
        checkpoint_every=p.checkpoint_every,
        bf16=p.bf16,
    )
    torch.manual_seed(ctx.seed)
    trainer = Trainer(model, tp, ctx, batches, loss_fn=weighted_lm_loss, name=f"finetune-{method}")
    t0 = time.perf_counter()
    result = trainer.run()
    summary = {
        **result.summary(),
        "train_time_s": time.perf_counter() - t0,
        "s_per_step": (time.perf_counter() - t0) / max(len(result.losses), 1),
        "loss_curve": loss_curve(result.losses),
    }
    model = trainer.model.eval()
    if ctx.is_main:
        model.save_pretrained(done)
        fsync_tree(done)
        write_json_atomic(done / "summary.json", summary)  # last: it marks the weights complete
    return model, summary


def freeze_head(model: Any) -> bool:
    """Stop training an untied LM head; False (nothing frozen) when it is tied to the inputs.

    Why: a context-extension fine-tune teaches the layers new positions; the vocabulary
    projection needs no change for that, and skipping its weight gradient removes one of the
    head's three GEMMs, which dominate a small model's step. Opt-in (``train_head: false``):
    on an undertrained base the fine-tune is also plain language-model training, and the head
    takes part of it. A tied head stays trainable, as freezing it would freeze the input
    embeddings too.
    """
    head, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or head.weight is inputs.weight:
        return False
    head.weight.requires_grad_(False)
    return True


def loss_curve(losses: list[float], points: int = 50) -> list[float]:
    """The per-step losses averaged into at most ``points`` buckets (kept in the metrics so a
    flat curve, i.e. a fine-tune that did not learn, is visible without the tracker)."""
    if not losses:
        return []
    size = max(1, -(-len(losses) // points))
    return [sum(losses[i : i + size]) / len(losses[i : i + size]) for i in range(0, len(losses), size)]


def save_output(ctx: "StageContext", model: Any, tokenizer: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Write the HF directory with the scaling in config.json; return the loader self-check."""
    out = ctx.out_dir
    model.generation_config.max_length = scaling.serving_length(cfg)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tokenizer_files.carry_chat(ctx.model_dir, out, generation_config=False)  # keeps the new max_length
    written = json.loads((out / "config.json").read_text())
    for key in ("rope_parameters", "max_position_embeddings", scaling.RECORD_KEY):
        written[key] = cfg[key]
    for key in ("rope_scaling", "rope_theta"):
        written.pop(key, None)
    scaling.write_model_dir_config(out, written)
    return check_written(out)


def check_written(model_dir: Path) -> dict[str, Any]:
    """Recompute the RoPE that transformers derives from the written config and compare."""
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = json.loads((model_dir / "config.json").read_text())
    ours, our_scale = scaling.inv_freq_of(cfg)
    hf_cfg = AutoConfig.from_pretrained(model_dir)
    layer = scaling.GLOBAL_LAYER if scaling.per_layer(cfg) else None
    rope_params = hf_cfg.rope_parameters[layer] if layer else hf_cfg.rope_parameters
    kind = rope_params["rope_type"]
    if kind == "default":
        dim = ours.numel() * 2
        ref = 1.0 / rope_params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        ref_scale = 1.0
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu", **({"layer_type": layer} if layer else {}))
    diff = float((ours - ref.to(torch.float64)).abs().max())
    if diff > 1e-5 or abs(our_scale - ref_scale) > 1e-6:
        raise RuntimeError(f"{model_dir}/config.json: transformers derives different RoPE (max diff {diff})")
    extra = {"scaled_layer_type": layer, "unscaled_layer_types": scaling.unscaled_layers(cfg)} if layer else {}
    return {
        **extra,
        "inv_freq_max_abs_diff": diff,
        "attention_scaling": float(ref_scale),
        "rope_type": kind,
        "max_position_embeddings": hf_cfg.max_position_embeddings,
        "context_length": scaling.serving_length(cfg),
    }


def run(ctx: "StageContext", p: "YarnParams") -> dict[str, Any]:
    """Entry point of ``context_ext.yarn`` (see the module docstring for the order of work)."""
    from transformers import AutoTokenizer

    plan = resolve(json.loads((ctx.model_dir / "config.json").read_text()), p)
    tokenizer = AutoTokenizer.from_pretrained(ctx.model_dir)
    corpus = ctx.corpus()
    lang = p.lang or corpus.config.target_lang
    other = corpus.config.source_lang if lang == corpus.config.target_lang else corpus.config.target_lang
    if not (corpus.texts(other, "validation") or corpus.texts(other, "test")):
        other = None  # a one-language corpus: nothing else to keep
    data = eval_data(tokenizer, corpus, lang, plan, p.ppl_documents, other, p.short_eval_tokens)
    # built before any evaluation, so a corpus that cannot feed the fine-tune fails in seconds
    batches = longdata.make_batches(
        tokenizer,
        corpus,
        lang,
        plan.target,
        p.batch_size,
        p.retrieval_fraction,
        ctx.seed,
        avoid_depths=p.depths,
        answer_weight=p.answer_weight,
        copy_fraction=p.copy_fraction,
        start_len=plan.original,
        steps=p.steps,
        curriculum=p.curriculum,
        lm_positions=p.lm_positions,
        source_lang=other,
        source_fraction=p.source_fraction,
    )
    settings = suite.EvalSettings(
        plan.lengths,
        plan.short_lengths,
        list(p.depths),
        p.min_trials,
        p.max_trials,
        p.ci_half_width,
        p.eval_batch_tokens,
        ctx.seed,
    )
    cache = ctx.checkpoint_dir / "eval"
    results: dict[str, dict[str, Any]] = {}
    for method in p.baselines:
        if method in plan.configs:
            name = suite.label(method, False)
            ctx.log.info("context_ext: evaluating %s", name)
            results[name] = _cached(
                cache / f"{name}.json",
                lambda m=method, n=name: suite.evaluate(
                    suite.load_variant(ctx.model_dir, plan.configs[m], _eval_dtype(p)), tokenizer, data, settings, n
                ),
            )
    train: dict[str, Any] = {}
    check: dict[str, Any] = {}
    for method in [p.method, *[m for m in p.finetune_baselines if m in plan.configs]]:
        name = suite.label(method, True)
        model, train[name] = finetune(ctx, p, plan, method, batches)
        if method == p.method and ctx.is_main:
            check = save_output(ctx, model, tokenizer, plan.configs[method])
        ctx.log.info("context_ext: evaluating %s", name)
        results[name] = _cached(
            cache / f"{name}.json",
            lambda m=model, n=name: suite.evaluate(m.to(_dtype(_eval_dtype(p))), tokenizer, data, settings, n),
        )
        del model
    return summarise(ctx, p, plan, results, train, check)


def _eval_dtype(p: "YarnParams") -> str:
    """The evaluation dtype's name: ``auto`` is bf16 only where the device computes it fast."""
    from warsha.precision import dtype_name

    return dtype_name(None, "auto") if p.eval_dtype == "auto" else p.eval_dtype


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def summarise(
    ctx: "StageContext",
    p: "YarnParams",
    plan: Plan,
    results: dict[str, Any],
    train: dict[str, Any],
    check: dict[str, Any],
) -> dict[str, Any]:
    """Metrics dict, markdown table and plot (the latter two written into the output dir)."""
    short = suite.short_context_ratios(results, plan.short_lengths) if "none" in results else {}
    short_source = (
        suite.short_context_ratios(results, plan.short_lengths, "perplexity_source") if "none" in results else {}
    )
    if ctx.is_main:
        md = report.table(results, plan.lengths, short, plan.original, short_source)
        (ctx.out_dir / "context_ext.md").write_text(f"# Context extension ({p.method}, factor {plan.factor:g})\n\n{md}")
        report.plot(results, plan.lengths, plan.original, ctx.out_dir / "context_ext.png")
    main = suite.label(p.method, True)
    headline = {f"passkey_{n / plan.original:g}x": results[main]["passkey"][str(n)]["accuracy"] for n in plan.lengths}
    return {
        "method": p.method,
        "factor": plan.factor,
        "original_max_position_embeddings": plan.original,
        "context_length": int(round(plan.original * plan.factor)),
        "target_length": plan.target,
        "lengths": plan.lengths,
        "short_lengths": plan.short_lengths,
        main: headline,
        "short_context_ratio": short,
        "short_context_ratio_other_language": short_source,
        "results": results,
        "train": train,
        "written_config": check,
        "skipped_baselines": plan.skipped,
        "peak_rss_gb": suite.peak_rss_gb(),
    }
