"""tokenizer_ext.embed: resizing, initialisers, padding, tied and untied heads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tokenizer_ext.conftest import make_ctx, with_model
from tokenizer_ext import embed
from tokenizer_ext.stages import EmbedParams


def _weights(path: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    head = model.get_output_embeddings()
    emb = model.get_input_embeddings().weight.detach()
    tied = head is None or head.weight is model.get_input_embeddings().weight
    return emb, None if tied else head.weight.detach()


def test_subword_mean_rows_match_base_tokenizer(sp_extended_dir: Path, sp_embedded_dir: Path) -> None:
    """Word-initial pieces: the base HF tokenizer on the piece's text gives the ids averaged."""
    from transformers import AutoTokenizer

    base_emb, base_head = _weights(sp_extended_dir)
    emb, head = _weights(sp_embedded_dir)
    base_tok = AutoTokenizer.from_pretrained(sp_extended_dir / "base_tokenizer")
    ext_tok = AutoTokenizer.from_pretrained(sp_extended_dir)
    n = len(ext_tok)
    checked = 0
    for i in range(32000, n):
        piece = ext_tok.convert_ids_to_tokens(i)
        if not piece.startswith("\u2581"):
            continue
        ids = base_tok(piece[1:], add_special_tokens=False)["input_ids"]
        torch.testing.assert_close(emb[i], base_emb[ids].mean(0))
        torch.testing.assert_close(head[i], base_head[ids].mean(0))
        checked += 1
    assert checked > 100
    torch.testing.assert_close(emb[:32000], base_emb)  # base rows untouched
    torch.testing.assert_close(head[:32000], base_head)


def test_padding_rows_initialised(sp_extended_dir: Path, sp_embedded_dir: Path) -> None:
    from transformers import AutoTokenizer

    n = len(AutoTokenizer.from_pretrained(sp_extended_dir))
    emb, head = _weights(sp_embedded_dir)
    base_emb, base_head = _weights(sp_extended_dir)
    assert emb.shape[0] % 64 == 0 and emb.shape[0] >= n
    for mat, base in ((emb, base_emb), (head, base_head)):
        for row in mat[n:]:
            torch.testing.assert_close(row, base.mean(0))
    cfg = json.loads((sp_embedded_dir / "config.json").read_text())
    assert cfg["vocab_size"] == emb.shape[0]
    side = json.loads((sp_embedded_dir / "tokenizer_ext.json").read_text())
    assert side["padded_vocab_size"] == emb.shape[0] and (sp_embedded_dir / "base_tokenizer").is_dir()


def test_unaligned_vocab_is_padded_to_multiple(tmp_path: Path, sp_extended_dir: Path, corpus: Any) -> None:
    """A tokenizer size bitsandbytes would reject is padded, and padding is mean-filled."""
    from transformers import AutoTokenizer

    n = len(AutoTokenizer.from_pretrained(sp_extended_dir))
    assert n % 32 != 0, "fixture should exercise padding"
    ctx = make_ctx(tmp_path, sp_extended_dir, corpus, "embed")
    metrics = embed.run(ctx, EmbedParams(pad_to_multiple_of=32, eval_docs=0, init="mean_all", domain_eval=[]))
    emb, _ = _weights(ctx.out_dir)
    assert emb.shape[0] == metrics["rows"] == -(-n // 32) * 32 and metrics["padding_rows"] > 0
    assert torch.isfinite(emb).all()
    base_emb, _ = _weights(sp_extended_dir)
    torch.testing.assert_close(emb[32000:], base_emb.mean(0).expand(emb.shape[0] - 32000, -1))


def test_random_init_follows_base_statistics() -> None:
    torch.manual_seed(0)
    weight = torch.randn(4000, 16) * 0.5 + 2.0
    rows = embed.new_rows(weight, 4000, [[1]] * 3000, "random", seed=3)
    assert torch.allclose(rows.mean(0), weight.mean(0), atol=0.05)
    assert torch.allclose(rows.std(0), weight.std(0), atol=0.05)
    with pytest.raises(ValueError, match="init"):
        embed.new_rows(weight, 4000, [[1]], "focus", seed=0)


def test_tied_embeddings(tmp_path: Path, sp_extended_dir: Path, corpus: Any) -> None:
    src = with_model(sp_extended_dir, tmp_path / "tied", tie=True)
    ctx = make_ctx(tmp_path, src, corpus, "embed")
    metrics = embed.run(ctx, EmbedParams(eval_docs=2, eval_max_length=32, domain_eval=[]))
    assert metrics["tied"] is True
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ctx.out_dir)
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    bpc = metrics["bits_per_char"]
    assert set(bpc) == {"base", "extended_init"} and all(v > 0 for d in bpc.values() for v in d.values())


def test_missing_sidecar_is_a_clear_error(tmp_path: Path, sp_model_dir: Path, corpus: Any) -> None:
    ctx = make_ctx(tmp_path, sp_model_dir, corpus, "embed")
    with pytest.raises(ValueError, match="run tokenizer_ext.extend"):
        embed.run(ctx, EmbedParams())


def test_other_domain_sets_are_scored_for_both_models(tmp_path: Path, sp_extended_dir: Path, corpus: Any) -> None:
    """embed scores the base and the freshly extended model on the other-domain sets: bits/char
    that equal one likelihood pass over each set, the paired change, and tokens per word."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenizer_ext import quality
    from warsha.evaluate import likelihood

    ctx = make_ctx(tmp_path, sp_extended_dir, corpus, "embed")
    m = embed.run(ctx, EmbedParams(eval_docs=0, domain_eval=["ar_msa", "en_essays"], domain_docs=3))
    report = m["other_domains"]
    assert set(report["sets"]) == {"ar_msa", "en_essays"} and report["sets"]["ar_msa"]["docs"] == 3
    base = AutoModelForCausalLM.from_pretrained(sp_extended_dir, dtype=torch.float32)
    base_tok = AutoTokenizer.from_pretrained(sp_extended_dir / "base_tokenizer")
    texts = quality.domain_texts(["ar_msa"], 3, corpus)["ar_msa"]
    whole = likelihood(base, base_tok, texts, EmbedParams().eval_max_length).bits_per_char
    assert report["bits_per_char"]["base"]["ar_msa"] == pytest.approx(whole, rel=1e-5)
    ratio = report["bits_per_char"]["extended_init"]["ar_msa"] / report["bits_per_char"]["base"]["ar_msa"]
    change = report["change_vs_base"]["extended_init"]["ar_msa"]
    assert change["change"] == pytest.approx(ratio - 1, rel=1e-9) and change["se"] > 0
    tpw = report["tokens_per_word"]["ar_msa"]
    assert tpw["extended_init"] < tpw["base"]  # the added Arabic pieces shorten Arabic text
    assert (
        report["tokens_per_word"]["en_essays"]["extended_init"]
        == pytest.approx(tpw_en := report["tokens_per_word"]["en_essays"]["base"])
        and tpw_en > 1
    )


def test_init_scale_shrinks_only_the_new_rows(
    tmp_path: Path, sp_extended_dir: Path, sp_embedded_dir: Path, corpus: Any
) -> None:
    """init_scale multiplies the new rows (the padding rows keep the plain mean of the base rows)."""
    ctx = make_ctx(tmp_path, sp_extended_dir, corpus, "embed")
    m = embed.run(ctx, EmbedParams(eval_docs=0, domain_eval=[], init_scale=0.6))
    assert m["init_scale"] == 0.6
    full, _ = _weights(sp_embedded_dir)
    shrunk, _ = _weights(ctx.out_dir)
    n = m["tokenizer_size"]
    torch.testing.assert_close(shrunk[:32000], full[:32000])
    torch.testing.assert_close(shrunk[32000:n], 0.6 * full[32000:n])
    torch.testing.assert_close(shrunk[n:], full[n:])


def test_an_embedded_model_is_refused_as_input(tmp_path: Path, sp_embedded_dir: Path, corpus: Any) -> None:
    """Its rows are set already, and its weights are no base for the fit's teacher."""
    ctx = make_ctx(tmp_path, sp_embedded_dir, corpus, "embed")
    with pytest.raises(ValueError, match="already went through embed.*tokenizer_ext.extend"):
        embed.run(ctx, EmbedParams(eval_docs=0, domain_eval=[]))
