"""Stage ``tokenizer_ext.extend``: learn target-language pieces and append them to the base.

Both families end in a directory that ``AutoTokenizer`` (fast) loads, next to the untouched
model weights (``tokenizer_ext.embed`` resizes them), the base tokenizer (``base_tokenizer/``,
which ``embed`` splits new pieces with) and ``tokenizer_ext.json`` (what was added).
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizer_ext import byte_bpe, checks, family, sp_bpe
from warsha import tokenizer_files
from warsha.data import has_script

if TYPE_CHECKING:
    from tokenizer_ext.stages import ExtendParams
    from warsha.stage import StageContext


def run(ctx: "StageContext", p: "ExtendParams") -> dict[str, Any]:
    """Validate inputs, train, merge, write the tokenizer, then measure it."""
    corpus = ctx.corpus()
    lang = corpus.config.target_lang
    train = [t for t in corpus.texts(lang, "train") if has_script(t, lang)]
    if not train:
        raise ValueError(
            f"data: the train split holds no {lang!r} text to learn pieces from; add files with"
            f" lang: {lang} (or use source: hadith)"
        )
    base = family.load_base(ctx.model_dir)
    n_added = _requested(p, base)
    script = family.piece_test(p.script, lang, p.letters_only)
    sample = sample_texts(train, p.max_train_chars, ctx.seed)
    t0 = time.perf_counter()
    if base.family == "sentencepiece":
        info = _extend_sp(ctx, p, base, sample, n_added, script)
    elif base.family == "byte_fallback":
        info = _extend_fallback(ctx, p, base, sample, n_added, script)
    else:
        info = _extend_byte(ctx, p, base, sample, n_added, script)
    info["train_seconds"] = time.perf_counter() - t0
    info["train_chars"] = sum(len(t) for t in sample)
    info["train_docs"] = len(sample)
    if ctx.is_main:
        family.copy_model_files(ctx.model_dir, ctx.out_dir)
        family.save_base_tokenizer(ctx.model_dir, ctx.out_dir / "base_tokenizer")
        tokenizer_files.carry_chat(ctx.model_dir, ctx.out_dir)  # a rebuilt tokenizer_config lost an inline template
        side = {
            "family": base.family,
            "base_vocab_size": base.size,
            "added": info["added_pieces"],
            "base_model": str(ctx.model_dir),
        }
        (ctx.out_dir / "tokenizer_ext.json").write_text(json.dumps(side, indent=2))
    metrics = {"family": base.family, "base_vocab_size": base.size, **info}
    metrics.update(measure(ctx, p, base, ctx.out_dir if ctx.is_main else None))
    return metrics


def _requested(p: "ExtendParams", base: family.BaseTokenizer) -> int:
    if p.vocab_size <= base.size:
        raise ValueError(
            f"vocab_size: {p.vocab_size} is not larger than the base tokenizer's {base.size} ids;"
            f" ask for base + the pieces to add, e.g. vocab_size: {base.size + 16000}"
        )
    return p.vocab_size - base.size


def sample_texts(texts: list[str], max_chars: int, seed: int) -> list[str]:
    """A seeded random subset of documents holding at most ``max_chars`` (0 = everything)."""
    if max_chars <= 0 or sum(len(t) for t in texts) <= max_chars:
        return texts
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    out, total = [], 0
    for i in order:
        if total + len(texts[i]) > max_chars:
            break
        out.append(texts[i])
        total += len(texts[i])
    return out


def _extend_sp(
    ctx: "StageContext",
    p: "ExtendParams",
    base: family.BaseTokenizer,
    sample: list[str],
    n_added: int,
    script: family.PieceTest | None,
) -> dict[str, Any]:
    """Train, merge and prune; pruning looks at training text only, so the held-out split
    that the checks report on never influenced which pieces were kept."""
    from warsha.sentencepiece_hf import sp_model_to_hf

    new = sp_bpe.train_bpe(sample, p.train_vocab_size or n_added, base.proto, p.character_coverage, seed=ctx.seed)
    merged = sp_bpe.merge_pieces(base.proto, new, n_added, script)
    added, dead_before = merged.added, 0
    if p.prune_unreachable:
        added, dead_before = sp_bpe.prune_unreached(merged.proto, base.proto, added, merged.scores, sample)
    if ctx.is_main:
        ctx.out_dir.mkdir(parents=True, exist_ok=True)
        (ctx.out_dir / "tokenizer.model").write_bytes(merged.proto.SerializeToString())
        sp_model_to_hf(ctx.out_dir / "tokenizer.model", ctx.out_dir)
    return {
        "added_pieces": len(added),
        "vocab_size": len(merged.proto.pieces),
        "rescored_base_pieces": merged.rescored_base,
        "skipped": {
            "in_base": merged.skipped_in_base,
            "not_target_script": merged.skipped_script,
            "no_merge_path": merged.skipped_no_path,
        },
        "pruned_unreachable": dead_before,
    }


def _extend_byte(
    ctx: "StageContext",
    p: "ExtendParams",
    base: family.BaseTokenizer,
    sample: list[str],
    n_added: int,
    script: family.PieceTest | None,
) -> dict[str, Any]:
    assert base.spec is not None
    merges = byte_bpe.train_merges(base.spec, sample, p.train_vocab_size or n_added)
    result = byte_bpe.extend(base.spec, merges, n_added, script)
    if ctx.is_main:
        _write_json_tokenizer(ctx, base, result.spec)
    return {
        "added_pieces": len(result.added),
        "vocab_size": base.size + len(result.added),
        "skipped": {
            "in_base": result.skipped_in_base,
            "not_target_script": result.skipped_script,
            "no_merge_path": result.skipped_no_path,
        },
        "pruned_unreachable": 0,
    }


def _extend_fallback(
    ctx: "StageContext",
    p: "ExtendParams",
    base: family.BaseTokenizer,
    sample: list[str],
    n_added: int,
    script: family.PieceTest | None,
) -> dict[str, Any]:
    """Continued BPE on the base's own segmentation: every added token is reachable by
    construction, so there is nothing to prune (the held-out check still counts)."""
    from tokenizer_ext import fallback_bpe

    assert base.spec is not None
    result = fallback_bpe.extend(base.spec, sample, n_added, script)
    if ctx.is_main:
        _write_json_tokenizer(ctx, base, result.spec)
    return {
        "added_pieces": len(result.added),
        "vocab_size": base.size + len(result.added),
        "method": "continued_bpe",
        "last_merge_pair_count": result.last_pair_count,
        "pruned_unreachable": 0,
    }


def _write_json_tokenizer(ctx: "StageContext", base: family.BaseTokenizer, spec: dict[str, Any]) -> None:
    """tokenizer.json plus the base's side files (or tekken's, for a converted tekken file)."""
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    (ctx.out_dir / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    src = base.source.parent
    side = [n for n in ("tokenizer_config.json", "special_tokens_map.json") if (src / n).is_file()]
    if base.source.name == "tokenizer.json" and side:
        for name in side:
            shutil.copy2(src / name, ctx.out_dir / name)
    else:
        byte_bpe.write_tekken_side_files(ctx.out_dir)


def measure(ctx: "StageContext", p: "ExtendParams", base: family.BaseTokenizer, out_dir: Path | None) -> dict[str, Any]:
    """Round trip, dead pieces, unchanged source language, fertility and pair ratio."""
    from transformers import AutoTokenizer

    if out_dir is None:
        return {}
    corpus = ctx.corpus()
    lang, src_lang = corpus.config.target_lang, corpus.config.source_lang
    tgt = _cap(corpus.texts(lang, "validation"), p.check_docs)
    src = _cap(corpus.texts(src_lang, "validation"), p.check_docs)
    base_tok = AutoTokenizer.from_pretrained(out_dir / "base_tokenizer")
    ext = AutoTokenizer.from_pretrained(out_dir)
    m: dict[str, Any] = {
        "normalisation": corpus.normalisation,
        "held_out_split": "validation",
        "round_trip": {lang: checks.round_trip(ext, tgt), src_lang: checks.round_trip(ext, src)},
        "unreachable_added": _unreached(base, ext, out_dir, tgt),
        f"{src_lang}_unchanged": checks.same_ids(_ids(base_tok, src), _ids(ext, src), src),
        "fertility": {
            lang: checks.fertility_report(base_tok, ext, tgt),
            src_lang: checks.fertility_report(base_tok, ext, src),
        },
        "pair_token_ratio": checks.pair_ratio(base_tok, ext, _cap(corpus.pairs_in("validation"), p.check_docs)),
    }
    if base.family == "sentencepiece":
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(out_dir / "tokenizer.model"))
        m["sentencepiece_round_trip"] = checks.sp_round_trip(sp, tgt + src)
        m["hf_matches_sentencepiece"] = checks.same_ids(sp.encode(tgt + src), _ids(ext, tgt + src), tgt + src)
    return m


def _unreached(base: family.BaseTokenizer, ext: Any, out_dir: Path, held_out: list[str]) -> int:
    """Added ids nothing produces: sentencepiece probes a piece's text without the dummy
    prefix (so word-internal pieces are tested as themselves); byte-level runs the BPE model on
    the token's exact bytes (a token may be part of a character, which no text can spell)."""
    if base.family == "sentencepiece":
        return len(sp_bpe.unreached(sp_bpe.load_proto(out_dir / "tokenizer.model"), base.size, held_out))
    return len(checks.byte_unreached(ext, base.size, held_out))


def _cap(items: list[Any], n: int) -> list[Any]:
    return items[:n] if n > 0 else items


def _ids(tok: Any, texts: list[str]) -> list[list[int]]:
    return tok(texts, add_special_tokens=False)["input_ids"]
