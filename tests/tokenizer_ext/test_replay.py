"""Replay: base-written sequences whose recorded top-k distributions match a full forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenizer_ext import replay


def test_recorded_distributions_match_a_forward_without_cache(sp_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(sp_model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(sp_model_dir)
    rep = replay.generate(model, tok, ["ar", "en", "ar"], seq_len=10, k=5, seed=3, batch=2)
    assert rep.ids.shape == (3, 10) and rep.top_ids.shape == (3, 9, 5) and rep.top_probs.shape == (3, 9, 5)
    assert (rep.ids[:, 0] == tok.bos_token_id).all()
    with torch.no_grad():
        logits = model(input_ids=rep.ids).logits[:, :-1].double()  # the brute-force reference
    values, index = torch.topk(logits, 5, -1)
    assert torch.equal(index, rep.top_ids)
    torch.testing.assert_close(rep.top_probs.double(), torch.softmax(values, -1), rtol=1e-4, atol=1e-6)
    again = replay.generate(model, tok, ["ar", "en", "ar"], seq_len=10, k=5, seed=3, batch=2)
    assert torch.equal(again.ids, rep.ids)  # seeded: a rerun writes the same text


def test_prompts_are_whole_words_of_the_language(sp_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(sp_model_dir)
    for lang, script in (("ar", "\u0621"), ("en", "a")):
        for ids in replay.prompts(tok, [lang] * 4, seed=1):
            words = tok.convert_ids_to_tokens(ids[1:])
            assert all(w.startswith("\u2581") and len(w) >= 3 for w in words)
            assert all(min(w[1:]) >= script for w in words)
    with pytest.raises(ValueError, match="no script known for language 'xx'"):
        replay.word_tokens(tok, "xx")


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    rep = replay.Replay(
        torch.arange(6).view(2, 3), torch.zeros(2, 2, 4, dtype=torch.long), torch.rand(2, 2, 4), ["ar", "en"]
    )
    rep.save(tmp_path / "r" / "replay.pt")
    back = replay.Replay.load(tmp_path / "r" / "replay.pt")
    assert torch.equal(back.ids, rep.ids) and torch.equal(back.top_probs, rep.top_probs) and back.langs == rep.langs
    batch = back.batch([1])
    assert batch["input_ids"].tolist() == [[3, 4, 5]] and batch["teacher_probs"].shape == (1, 2, 4)
