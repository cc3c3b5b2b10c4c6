"""Draft construction: copied weights, identical vocabulary, rope config, bad-input refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from distill import draft as drafting


def test_layer_subset_copies_chosen_layers_and_shared_parts(target: Any) -> None:
    d = drafting.layer_subset(target, [0, 2])
    assert d.config.num_hidden_layers == 2
    assert d.config.rope_parameters == target.config.rope_parameters
    assert d.config.max_position_embeddings == target.config.max_position_embeddings
    ts, ds = target.state_dict(), d.state_dict()
    for name, value in ds.items():
        src = name.replace("model.layers.1.", "model.layers.2.")
        assert torch.equal(value, ts[src]), name
    for shared in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(ds[shared], ts[shared])


def test_full_subset_reproduces_the_target(target: Any) -> None:
    d = drafting.layer_subset(target, [0, 1, 2, 3]).eval()
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    with torch.inference_mode():
        torch.testing.assert_close(d(input_ids=ids).logits, target(input_ids=ids).logits)


def test_saved_draft_loads_with_auto_classes(tmp_path: Path, target: Any, target_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = drafting.layer_subset(target, [1]).eval()
    drafting.save_draft(d, target_dir, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert drafting.first_vocab_difference(AutoTokenizer.from_pretrained(target_dir), tok) is None
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == "yarn"
    assert cfg["rope_parameters"]["factor"] == target.config.rope_parameters["factor"]
    ids = torch.tensor([tok("Narrated Abu Huraira")["input_ids"]])
    with torch.inference_mode():
        torch.testing.assert_close(loaded(input_ids=ids).logits, d(input_ids=ids).logits)


@pytest.mark.parametrize("layers", [[0, 4], [7], [-5]])
def test_missing_layers_are_refused(target: Any, layers: list[int]) -> None:
    with pytest.raises(ValueError, match=r"do not exist; the target has 4 layers"):
        drafting.layer_subset(target, layers)


def test_unordered_layers_are_refused(target: Any) -> None:
    with pytest.raises(ValueError, match="increasing"):
        drafting.check_layers([2, 1], 4)


def _swapped_tokenizer(src: Path, dst: Path, a: int, b: int) -> Path:
    """A copy of a tokenizer in which pieces ``a`` and ``b`` trade ids."""
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "special")):
            shutil.copy2(f, dst / f.name)
    tj = json.loads((dst / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    inv = {i: s for s, i in vocab.items()}
    vocab[inv[a]], vocab[inv[b]] = b, a
    (dst / "tokenizer.json").write_text(json.dumps(tj))
    return dst


def test_foreign_vocabulary_is_refused_naming_the_first_id(tmp_path: Path, target: Any, target_dir: Path) -> None:
    from transformers import AutoTokenizer

    other = _swapped_tokenizer(target_dir, tmp_path / "other", 120, 130)
    t_tok, o_tok = AutoTokenizer.from_pretrained(target_dir), AutoTokenizer.from_pretrained(other)
    assert drafting.first_vocab_difference(t_tok, o_tok)[0] == 120
    with pytest.raises(ValueError, match="differs from the target's at id 120"):
        drafting.assert_same_vocab(t_tok, o_tok, target.config, target.config)


def test_vocab_size_mismatch_is_refused(target: Any, tokenizer: Any, make_config: Any) -> None:
    small = make_config(target.config.vocab_size - 10, layers=1)
    with pytest.raises(ValueError, match=f"at id {target.config.vocab_size - 10}"):
        drafting.assert_same_vocab(tokenizer, tokenizer, target.config, small)


def test_larger_draft_warns(target: Any) -> None:
    with pytest.warns(UserWarning, match="not fewer than the target"):
        assert drafting.warn_if_larger(drafting.from_config(target, 128, 256, 6, 4, 2, "random"), target)
    assert not drafting.warn_if_larger(drafting.layer_subset(target, [0]), target)


def test_embedding_copy_same_width(target: Any) -> None:
    d = drafting.from_config(target, 64, 96, 1, 4, 2, "embedding")
    assert torch.equal(d.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(d.lm_head.weight, target.lm_head.weight)
    assert d.config.rope_parameters == target.config.rope_parameters
    r = drafting.from_config(target, 64, 96, 1, 4, 2, "random")
    assert not torch.equal(r.model.embed_tokens.weight, target.model.embed_tokens.weight)


def test_embedding_projection_is_the_best_low_rank_summary(target: Any) -> None:
    d = drafting.from_config(target, 32, 64, 1, 4, 2, "embedding")
    assert d.config.head_dim == 8 and d.model.embed_tokens.weight.shape == (target.config.vocab_size, 32)
    e = target.model.embed_tokens.weight.detach().double().numpy()
    _, sv, vt = np.linalg.svd(e, full_matrices=False)
    got = d.model.embed_tokens.weight.detach().double().numpy()
    # Eckart-Young: projecting back loses exactly the trailing singular values
    residual = np.linalg.norm(e - got @ vt[:32])
    assert residual == pytest.approx(np.sqrt((sv[32:] ** 2).sum()), rel=1e-4)
    with pytest.raises(ValueError, match="wider"):
        drafting.project_rows(target.model.embed_tokens.weight, 128)
