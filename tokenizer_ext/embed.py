"""Stage ``tokenizer_ext.embed``: resize input embeddings and LM head, initialise new rows.

Default initialisation: each new row is the mean of the base rows of the pieces the *base*
tokenizer splits the new piece's text into. The model then starts out treating the new token
roughly as the sequence it replaces, which is why extended models recover quickly (SambaLingo,
Yamaguchi et al.). Padding rows (to a multiple of ``pad_to_multiple_of``) get the mean of all
base rows: never an uninitialised row, whatever the resize left there. Under ZeRO-3 the
partitioned matrices are gathered before rows are written (``modifier_rank=0`` broadcasts
rank 0's writes back into every partition).

With ``fit.steps`` the initialised rows are then fitted to the base (``fit_rows``): only the
new rows train (or, with ``fit_map``, one map from each piece's subword rows to its row),
against the base reading the base tokenization of the same text, and the report scores the
model before the fit (``before_fit``) beside the fitted one (``extended_init``).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizer_ext import byte_bpe, sp_bpe
from warsha import tokenizer_files

if TYPE_CHECKING:
    import torch

    from tokenizer_ext.stages import EmbedParams
    from warsha.stage import StageContext

SIDECAR = "tokenizer_ext.json"


def read_sidecar(model_dir: Path, stage: str) -> dict[str, Any]:
    """What ``extend`` recorded; a clear error when the input did not come from it."""
    path = Path(model_dir) / SIDECAR
    if not path.is_file():
        raise ValueError(f"{stage}: {model_dir} has no {SIDECAR}; run tokenizer_ext.extend before this stage")
    return json.loads(path.read_text())


def base_splits(model_dir: Path, first: int, n: int) -> list[list[int]]:
    """For ids ``first..n-1`` of the extended tokenizer: the base ids its text splits into.

    SentencePiece: the base model encodes the piece's text without the dummy prefix (a
    word-internal piece is not a word start). Byte-level: the base merges are applied to the
    token's bytes directly, which also covers tokens that are not whole UTF-8 characters.
    """
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.model").is_file():
        ext = sp_bpe.load_proto(model_dir / "tokenizer.model")
        base = sp_bpe.processor(sp_bpe.load_proto(model_dir / "base_tokenizer" / "tokenizer.model"), False)
        texts = [ext.pieces[i].piece.replace(sp_bpe.SPACE, " ") for i in range(first, n)]
        return [list(ids) for ids in base.encode(texts)]
    ext_spec = json.loads((model_dir / "tokenizer.json").read_text())
    base_spec = json.loads((model_dir / "base_tokenizer" / "tokenizer.json").read_text())
    by_id = {i: t for t, i in ext_spec["model"]["vocab"].items()}
    ranks = {m: r for r, m in enumerate(byte_bpe.merge_list(base_spec))}
    vocab = base_spec["model"]["vocab"]
    return [[vocab[part] for part in byte_bpe.bpe_split(by_id[i], ranks)] for i in range(first, n)]


@contextlib.contextmanager
def gathered(params: Sequence["torch.nn.Parameter"]) -> Iterator[None]:
    """Full parameters inside the block, also when ZeRO-3 has partitioned them."""
    if any(hasattr(q, "ds_id") for q in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params), modifier_rank=0):
            yield
    else:
        yield


def new_rows(weight: "torch.Tensor", base_n: int, sources: list[list[int]], init: str, seed: int) -> "torch.Tensor":
    """Rows for the new ids, computed in float32 from the first ``base_n`` rows."""
    import torch

    base = weight[:base_n].float()
    if init == "mean_all" or not sources:
        return base.mean(0).expand(len(sources), -1).clone()
    if init == "random":
        gen = torch.Generator().manual_seed(seed)
        mu, sd = base.mean(0), base.std(0)
        return mu + sd * torch.randn(len(sources), base.shape[1], generator=gen)
    if init != "subword_mean":
        raise ValueError(f"init: unknown initialiser {init!r}; use subword_mean, random or mean_all")
    return torch.stack([base[ids].mean(0) if ids else base.mean(0) for ids in sources])


def initialise(
    model: Any, base_n: int, sources: list[list[int]], init: str, seed: int, scale: float = 1.0
) -> dict[str, Any]:
    """Write new rows ``base_n..base_n+len(sources)-1`` (times ``scale``) and mean-fill every later
    (padding) row.

    Why a scale: a new row serves as an output row too (always, when tied); the mean of its
    pieces' rows scores it by the average of their logits, which on the real Gemma 3 270M gives
    new pieces too much probability where they are wrong. Shrunk to 0.6-0.8x, step-0 bits per
    character outside the corpus fell by 6-7 points (docs/adaptation.md)."""
    import torch

    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    matrices = [emb] if head is None or head.weight is emb else [emb, head.weight]
    with gathered(matrices), torch.no_grad():
        for i, w in enumerate(matrices):
            rows = new_rows(w, base_n, sources, init, seed + i) * scale
            w[base_n : base_n + len(sources)] = rows.to(w.dtype)
            w[base_n + len(sources) :] = w[:base_n].float().mean(0).to(w.dtype)
    return {"tied": len(matrices) == 1}


def untie(model: Any) -> bool:
    """Give a tied model a separate output matrix, a copy of its embedding (False: not tied).

    Why: tied, a new piece's one row must both read like its subwords (input) and score like
    their chain (output), and the two want different vectors (docs/adaptation.md)."""
    import torch

    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight is not emb:
        return False
    head.weight = torch.nn.Parameter(emb.detach().clone())
    for cfg in (model.config, getattr(model.config, "text_config", None)):
        if cfg is not None:
            cfg.tie_word_embeddings = False
    return True


def padded_size(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple (bitsandbytes 4-bit kernels want multiples of 32)."""
    return int(math.ceil(n / multiple) * multiple)


def run(ctx: "StageContext", p: "EmbedParams") -> dict[str, Any]:
    """Resize, initialise, save, and score base vs. freshly extended model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    side = read_sidecar(ctx.model_dir, "tokenizer_ext.embed")
    if "padded_vocab_size" in side:
        raise ValueError(
            f"tokenizer_ext.embed: {ctx.model_dir} already went through embed (its new rows are set);"
            " map the tokenizer_ext.extend artifact as this stage's model input"
        )
    ext_tok = AutoTokenizer.from_pretrained(ctx.model_dir)
    base_n = int(side["base_vocab_size"])
    model = AutoModelForCausalLM.from_pretrained(ctx.model_dir, dtype=torch.float32)
    rows_before = model.get_input_embeddings().weight.shape[0]
    if rows_before < base_n:
        raise ValueError(
            f"{ctx.model_dir}: the model has {rows_before} embedding rows but its base tokenizer"
            f" uses {base_n} ids; the model and tokenizer do not belong together"
        )
    sources = base_splits(ctx.model_dir, base_n, len(ext_tok))
    target = padded_size(len(ext_tok), p.pad_to_multiple_of)
    model.resize_token_embeddings(target, mean_resizing=False)
    model.config.vocab_size = target
    if p.untie:
        untie(model)
    info = initialise(model, base_n, sources, p.init, ctx.seed, p.init_scale)
    metrics: dict[str, Any] = {
        "init": p.init,
        "init_scale": p.init_scale,
        "base_rows": rows_before,
        "tokenizer_size": len(ext_tok),
        "rows": target,
        "padding_rows": target - len(ext_tok),
        "tied": info["tied"],
        "mean_pieces_per_new_row": sum(map(len, sources)) / max(len(sources), 1),
    }
    scoring = bool(p.eval_docs or p.domain_eval)
    sets = _sets(ctx, p)
    scores = {"base": _base_scores(ctx, p, sets)} if scoring else {}
    if p.fit.steps:
        if scoring:
            scores["before_fit"] = _scores(ctx, p, model, ext_tok, sets)
        from tokenizer_ext import fit_rows

        metrics["fit"] = fit_rows.fit(ctx, p, model, ext_tok, base_n, sources)
    if scoring:
        scores["extended_init"] = _scores(ctx, p, model, ext_tok, sets)
        metrics.update(_report(scores, sets))
    if ctx.is_main:
        model.save_pretrained(ctx.out_dir)
        carry_tokenizer(ctx.model_dir, ctx.out_dir, {**side, "padded_vocab_size": target, "init": p.init})
    return metrics


def carry_tokenizer(src: Path, dst: Path, side: dict[str, Any]) -> None:
    """Tokenizer files and chat setup (``warsha.tokenizer_files``: the template and the stop ids
    overwrite what ``save_pretrained`` wrote), the base tokenizer and the sidecar travel with
    every later artifact."""
    tokenizer_files.copy_tokenizer(src, dst)
    if (src / "base_tokenizer").is_dir():
        shutil.copytree(src / "base_tokenizer", dst / "base_tokenizer", dirs_exist_ok=True)
    (dst / SIDECAR).write_text(json.dumps(side, indent=2))


def _sets(ctx: "StageContext", p: "EmbedParams") -> dict[str, list[str]]:
    """The other-domain held-out sets the stage scores (none when ``domain_eval`` is empty)."""
    from tokenizer_ext import quality

    return quality.domain_texts(p.domain_eval, p.domain_docs, ctx.corpus()) if p.domain_eval else {}


def _base_scores(ctx: "StageContext", p: "EmbedParams", sets: dict[str, list[str]]) -> dict[str, Any]:
    """The base model on the base tokenizer: the reference every row of the report is set against."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_model = AutoModelForCausalLM.from_pretrained(ctx.model_dir, dtype=torch.float32)
    base_tok = AutoTokenizer.from_pretrained(ctx.model_dir / "base_tokenizer")
    return _scores(ctx, p, base_model, base_tok, sets)


def _scores(ctx: "StageContext", p: "EmbedParams", model: Any, tok: Any, sets: dict[str, list[str]]) -> dict[str, Any]:
    """One model's bits per character on the corpus's held-out text, per-document NLLs on the
    other-domain sets and its tokens per word there."""
    from tokenizer_ext import quality
    from warsha.evaluate import fertility, hf_encoder

    out: dict[str, Any] = {}
    if p.eval_docs:
        out["bits_per_char"] = quality.bits_per_char(model, tok, ctx.corpus(), p.eval_docs, p.eval_max_length)
    if sets:
        out["nll"] = quality.document_nll(model, tok, sets, p.eval_max_length)
        out["tokens_per_word"] = {
            name: fertility(hf_encoder(tok), texts).tokens_per_word for name, texts in sets.items()
        }
    return out


def _report(scores: dict[str, dict[str, Any]], sets: dict[str, list[str]]) -> dict[str, Any]:
    """Every scored model against the base: bits per character, and on the other-domain sets the
    paired change per document (``quality.domain_report``) with tokens per word."""
    from tokenizer_ext import quality

    out: dict[str, Any] = {}
    if any("bits_per_char" in s for s in scores.values()):
        out["bits_per_char"] = {name: s["bits_per_char"] for name, s in scores.items()}
    if sets:
        report = quality.domain_report({name: s["nll"] for name, s in scores.items()}, sets, reference="base")
        report["tokens_per_word"] = {
            name: {who: s["tokens_per_word"][name] for who, s in scores.items()} for name in sets
        }
        out["other_domains"] = report
    return out
