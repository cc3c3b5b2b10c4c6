"""Fitting the new rows to the base model before any other training (``tokenizer_ext.embed``'s
``fit``): only the new rows of the embedding (and of an untied head) move, against the base
reading the base tokenization of the same text (``cross_tok``).

Why in ``embed``: an initialiser that copies subword rows leaves the extended model 33-44%
worse than its base outside the training corpus at step 0 (docs/adaptation.md), and training
that starts there spends its budget undoing it while the body drifts. Fitting the new rows
alone cannot change anything the base does with base tokens: the base rows and every other
weight are frozen, so the extended model only learns when and how to use its new pieces.

With ``fit_map`` the rows are not trained one by one: one linear map from each piece's subword
rows to its row is (``row_map``), so every occurrence of any piece teaches every piece.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizer_ext.stages import EmbedParams
    from warsha.stage import StageContext

log = logging.getLogger("warsha.embed")


def trained_matrices(model: Any) -> list[Any]:
    """The embedding, and the head when it is a separate matrix: where new rows live."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    return [emb] if head is None or head.weight is emb else [emb, head.weight]


def fit(
    ctx: "StageContext", p: "EmbedParams", model: Any, ext_tok: Any, base_n: int, sources: list[list[int]]
) -> dict[str, Any]:
    """Train rows ``base_n..`` of ``model`` for ``p.fit.steps`` steps; the loss curve and rate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenizer_ext import chain_teacher, cross_tok, mix, row_lr
    from warsha.training import Trainer

    teacher = AutoModelForCausalLM.from_pretrained(ctx.model_dir, dtype=torch.float32)
    base_tok = AutoTokenizer.from_pretrained(ctx.model_dir / "base_tokenizer")
    texts = mix.mixed_texts(ctx.corpus(), p.fit_source_fraction, ctx.seed)
    t, pad = p.fit, ext_tok.pad_token_id if ext_tok.pad_token_id is not None else 0
    n_written = round(t.batch_size * p.fit_replay_fraction)
    written = _written(ctx, p, teacher, base_tok) if n_written else []
    matrices = trained_matrices(model)
    for q in model.parameters():
        q.requires_grad_(not p.fit_map and any(q is m for m in matrices))
    reads = _reads(p, teacher, base_tok, sources, matrices[0][:base_n]) if p.fit_map and p.fit_map_reads else None
    row_map = _attach_map(model, matrices, base_n, sources, p.init_scale, reads) if p.fit_map else None

    def batch_fn(step: int, micro: int, rank: int) -> dict[str, Any]:
        key = f"{ctx.seed}/{step}/{micro}/{rank}"
        windows = cross_tok.sample_windows(texts, t.batch_size - n_written, ext_tok, base_tok, t.seq_len, key)
        if n_written:
            windows += cross_tok.sample_windows(written, n_written, ext_tok, base_tok, t.seq_len, f"{key}/written")
        return cross_tok.collate(windows, pad)

    def freeze_base_rows(opt: Any) -> None:
        for weight in matrices:
            row_lr.scale_leading_rows(opt, weight, base_n, 0.0)

    firsts = cross_tok.first_pieces(sources)
    chain = (chain_teacher.chain_groups(sources, base_n), p.fit_chain_weight) if p.fit_chain_weight else None
    loss_fn = cross_tok.loss_fn(
        teacher, firsts, base_n, p.fit_top_k, p.fit_distill_weight, p.fit_nll_weight, chain=chain
    )
    trainer = Trainer(
        model=model,
        p=t,
        ctx=ctx,
        batch_fn=batch_fn,
        loss_fn=loss_fn if row_map is None else _mapped_loss(loss_fn, row_map, matrices),
        name="embed_fit",
        parameters=matrices if row_map is None else list(row_map.parameters()),
        on_optimizer=freeze_base_rows if row_map is None else None,
    )
    result = trainer.run()
    if row_map is not None:
        row_map.write(matrices)
        model._modules.pop("warsha_row_map")
    step = max(1, len(result.losses) // 50)
    return {
        **result.summary(),
        "loss_curve": result.losses[::step],
        "distill_weight": p.fit_distill_weight,
        "nll_weight": p.fit_nll_weight,
        "chain_weight": p.fit_chain_weight,
        "map_reads": list(p.fit_map_reads),
        "replay_windows_per_batch": n_written,
        "replay_docs": len(written),
        "trained": "map" if row_map is not None else "rows",
    }


def _attach_map(
    model: Any, matrices: list[Any], base_n: int, sources: list[list[int]], scale: float, reads: Any = None
) -> Any:
    """A ``row_map.RowMap`` registered on ``model`` (its checkpoints carry the maps)."""
    from tokenizer_ext import row_map

    rmap = row_map.RowMap(matrices, base_n, sources, scale, reads)
    model.add_module("warsha_row_map", rmap)
    return rmap


def _reads(p: "EmbedParams", teacher: Any, base_tok: Any, sources: list[list[int]], base_rows: Any) -> Any:
    """``row_map.read_features`` of the base for ``p.fit_map_reads``, each block at
    ``p.fit_map_read_scale`` times the mean norm of ``base_rows``: the map's block for them starts
    at zero, and Adam moves it by about the rate per weight whatever the features' size, so that
    factor is the block's learning rate relative to the rest of the map."""
    from tokenizer_ext import row_map

    states = teacher.config.get_text_config().num_hidden_layers + 1
    bad = [i for i in p.fit_map_reads if not -states <= i < states]
    if bad:
        raise ValueError(
            f"tokenizer_ext.embed: fit_map_reads {bad} out of range: the base has {states} hidden states"
            f" (0 = the embeddings, {states - 1} or -1 = the final one)"
        )
    norm = float(base_rows.detach().float().norm(dim=1).mean())
    log.info("fit: the base reads the %d new pieces' splits (hidden states %s)", len(sources), p.fit_map_reads)
    return row_map.read_features(teacher, base_tok.bos_token_id, sources, p.fit_map_reads, norm * p.fit_map_read_scale)


def _mapped_loss(loss_fn: Any, rmap: Any, matrices: list[Any]) -> Any:
    """``loss_fn`` with the model's new rows taken from the map, so the loss trains the map."""
    from tokenizer_ext import row_map

    def fn(model: Any, batch: dict[str, Any]) -> Any:
        with row_map.mapped(model, rmap, matrices):
            return loss_fn(model, batch)

    return fn


def _written(ctx: "StageContext", p: "EmbedParams", teacher: Any, base_tok: Any) -> list[str]:
    """Target-language documents the base writes (``replay.written_texts``): the fit's windows
    from outside the corpus, where the new rows must learn to stay out of the base's way."""
    from tokenizer_ext import replay

    lang = ctx.corpus().config.target_lang
    log.info("fit: the base writes %d %r documents of %d tokens to fit on", p.fit_replay_docs, lang, p.fit.seq_len)
    return replay.written_texts(teacher, base_tok, lang, p.fit_replay_docs, p.fit.seq_len, ctx.seed)
