"""The shared row map (``tokenizer_ext.row_map``, ``embed``'s ``fit_map``): its features against
a brute-force loop, its gradient against float64 autograd through a plain embedding, and the
fit through it on a small model."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from tests.tokenizer_ext.conftest import make_ctx, tiny_llama, with_model
from tests.tokenizer_ext.test_cross_tok import _fit_params, _held_out_distill
from tokenizer_ext import embed, row_map

SOURCES = [[3, 1, 4], [1, 5], [], [9]]


def test_features_are_mean_first_last_and_one() -> None:
    base = torch.randn(12, 5, dtype=torch.float64)
    f = row_map.features(base, SOURCES)
    assert f.shape == (4, 16) and f.dtype == torch.float32
    for i, ids in enumerate(SOURCES):
        rows = [base[j] for j in ids] or [base[j] for j in range(12)]
        mean = sum(rows) / len(rows)
        first, last = (base[ids[0]], base[ids[-1]]) if ids else (mean, mean)
        want = torch.cat([mean, first, last, torch.ones(1, dtype=torch.float64)]).float()
        torch.testing.assert_close(f[i], want)


def test_the_map_starts_as_the_scaled_subword_mean() -> None:
    """At step 0 the map writes what ``embed.initialise`` wrote: the fit starts where the rows fit starts."""
    weight = torch.nn.Parameter(torch.randn(16, 6))
    sources = [[1, 2], [3], [4, 5, 6]]
    rmap = row_map.RowMap([weight], 10, sources, scale=0.6)
    want = 0.6 * embed.new_rows(weight.detach(), 10, sources, "subword_mean", seed=0)
    torch.testing.assert_close(rmap.rows(0), want)


def test_gradient_reaches_the_map_through_the_chain_rule(tmp_path: Path) -> None:
    """Tied and untied: the map's gradient equals features^T times the loss's gradient on the new
    rows of a plain float64 model holding the same matrices; the parameters are back after the
    block and untouched."""
    from tokenizer_ext.fit_rows import trained_matrices

    first, sources = 20, [[1, 2], [3, 4, 5], [6]]
    ids = torch.tensor([[0, 20, 7, 21, 22, 3]])
    for tie in (True, False):
        model = tiny_llama(tmp_path / f"m{tie}", 24, tie).double()
        matrices = trained_matrices(model)
        before = [w.detach().clone() for w in matrices]
        rmap = row_map.RowMap(matrices, first, sources, scale=1.0).double()
        for m in rmap.maps:
            m.data += 0.01 * torch.randn_like(m)  # away from the identity start
        with row_map.mapped(model, rmap, matrices):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert model.get_input_embeddings().weight is matrices[0]
        for w, b in zip(matrices, before):
            assert isinstance(w, torch.nn.Parameter) and torch.equal(w.detach(), b)
        ref = tiny_llama(tmp_path / f"r{tie}", 24, tie).double()
        ref_matrices = trained_matrices(ref)
        with torch.no_grad():
            for i, w in enumerate(ref_matrices):
                w[first : first + 3] = rmap.rows(i)
        ref(input_ids=ids, labels=ids).loss.backward()
        assert len(rmap.maps) == (1 if tie else 2)
        for i, w in enumerate(ref_matrices):
            want = getattr(rmap, f"features_{i}").double().T @ w.grad[first : first + 3]
            torch.testing.assert_close(rmap.maps[i].grad, want)


def test_fit_map_moves_only_new_rows_and_brings_the_model_to_its_base(
    tmp_path: Path, trained_base: Path, tokenizers: tuple[Any, Any], corpus: Any
) -> None:
    """The fit through the map, as the rows fit's test: the base rows and every other weight stay
    bit for bit, the new rows move, the saved model carries no map, and the cross-tokenizer
    loss on held-out windows falls."""
    from transformers import AutoModelForCausalLM

    unfitted = make_ctx(tmp_path, trained_base, corpus, "embed0")
    embed.run(unfitted, _fit_params(0))
    ctx = make_ctx(tmp_path, trained_base, corpus, "embed")
    metrics = embed.run(ctx, _fit_params(20, lr=3e-3, fit_nll_weight=0.0, fit_map=True))
    assert metrics["fit"]["steps_run"] == 20 and metrics["fit"]["trained"] == "map"
    before = AutoModelForCausalLM.from_pretrained(unfitted.out_dir, dtype=torch.float32).state_dict()
    after = AutoModelForCausalLM.from_pretrained(ctx.out_dir, dtype=torch.float32).state_dict()
    assert set(after) == set(before)
    n = len(tokenizers[0])
    for name, value in after.items():
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            torch.testing.assert_close(value[:32000], before[name][:32000], rtol=0, atol=0)
            torch.testing.assert_close(value[n:], before[name][n:], rtol=0, atol=0)
            assert (value[32000:n] - before[name][32000:n]).abs().amax() > 1e-3, name
        else:
            torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    start = _held_out_distill(unfitted.out_dir, tokenizers, corpus, trained_base)
    end = _held_out_distill(ctx.out_dir, tokenizers, corpus, trained_base)
    assert end < 0.9 * start, (start, end)
    shutil.rmtree(ctx.out_dir)


def test_fit_map_on_an_untied_head_maps_both_matrices(tmp_path: Path, sp_extended_dir: Path, corpus: Any) -> None:
    src = with_model(sp_extended_dir, tmp_path / "untied", tie=False)
    unfitted = make_ctx(tmp_path, src, corpus, "embed0")
    embed.run(unfitted, _fit_params(0))
    ctx = make_ctx(tmp_path, src, corpus, "embed")
    embed.run(ctx, _fit_params(2, fit_map=True))
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(unfitted.out_dir, dtype=torch.float32).state_dict()
    after = AutoModelForCausalLM.from_pretrained(ctx.out_dir, dtype=torch.float32).state_dict()
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert not torch.equal(after[name][32000:32100], before[name][32000:32100]), name
        torch.testing.assert_close(after[name][:32000], before[name][:32000], rtol=0, atol=0)


def test_a_mapped_matrix_is_marked_with_its_mapped_rows() -> None:
    """``RowMap.full`` marks the assembled matrix with the new rows' ids and the very tensor it
    holds there, so the fused losses form the gradient for those rows only."""
    from warsha.lm_loss import trained_rows

    w = torch.nn.Parameter(torch.randn(26, 6))
    rmap = row_map.RowMap([w], 20, [[1, 2], [3], [4, 5]], scale=1.0)
    full = rmap.full(0, w)
    ids, values = trained_rows(full)
    assert ids.tolist() == [20, 21, 22] and values.requires_grad
    assert torch.equal(full[20:23], values) and torch.equal(full[:20], w.detach()[:20])
    assert trained_rows(w) is None


def test_read_features_are_the_base_reading_each_split_alone(tmp_path: Path) -> None:
    """Batched by length with padding, against one unpadded forward per piece; each block is
    scaled to the asked mean norm, an empty split reads zeros."""
    model = tiny_llama(tmp_path / "m", vocab=40, tie=True).eval()
    sources = [[3, 1, 4], [1, 5], [], [9], [7, 7, 2, 8]]
    got = row_map.read_features(model, 0, sources, [1, -1], norm=2.5, batch=2)
    assert got.shape == (5, 2 * 64)
    with torch.no_grad():
        want = torch.zeros(5, 2, 64)
        for i, ids in enumerate(sources):
            if ids:
                states = model(input_ids=torch.tensor([[0, *ids]]), output_hidden_states=True).hidden_states
                want[i, 0], want[i, 1] = states[1][0, -1], states[-1][0, -1]
    want = want * (2.5 / want.norm(dim=2).sum(0) * 4)[None, :, None]  # four non-empty splits
    torch.testing.assert_close(got, want.reshape(5, 128), atol=1e-5, rtol=1e-4)
    assert got.reshape(5, 2, 64)[[0, 1, 3, 4]].norm(dim=2).mean(0).sub(2.5).abs().max() < 1e-4


def test_a_map_with_reads_starts_as_the_subword_mean() -> None:
    weight = torch.nn.Parameter(torch.randn(16, 6))
    sources = [[1, 2], [3], [4, 5, 6]]
    rmap = row_map.RowMap([weight], 10, sources, scale=1.0, reads=torch.randn(3, 12))
    assert rmap.maps[0].shape == (3 * 6 + 1 + 12, 6)
    torch.testing.assert_close(rmap.rows(0), embed.new_rows(weight.detach(), 10, sources, "subword_mean", seed=0))


def test_fit_map_reads_train_the_reads_block_and_check_their_layers(
    tmp_path: Path, trained_base: Path, corpus: Any
) -> None:
    import pytest

    from tokenizer_ext.stages import EmbedParams

    assert EmbedParams(fit_map_reads=[1]).validate() and not EmbedParams(fit_map=True, fit_map_reads=[1]).validate()
    ctx = make_ctx(tmp_path, trained_base, corpus, "embed")
    metrics = embed.run(ctx, _fit_params(2, fit_map=True, fit_map_reads=[1, -1]))
    assert metrics["fit"]["map_reads"] == [1, -1] and metrics["fit"]["steps_run"] == 2
    bad = make_ctx(tmp_path, trained_base, corpus, "embed_bad")
    with pytest.raises(ValueError, match="fit_map_reads \\[7\\] out of range"):
        embed.run(bad, _fit_params(2, fit_map=True, fit_map_reads=[7]))
