"""The chat evaluation's figures against hand-computed values, and one real greedy run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenizer_ext.chat_quality import answer_record, compare, script_share, summarise

SPECIAL = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>"}
WORDS = {10: "مرحبا", 11: " بكم", 12: " hello", 13: " 42"}


def decode(ids: list[int]) -> str:
    return "".join(WORDS[i] for i in ids)


def test_script_share_counts_letters_only() -> None:
    # 5 Arabic letters, 5 Latin letters; digits, spaces and punctuation are not letters
    assert script_share("مرحبا hello, 42!", "ARABIC") == pytest.approx(0.5)
    assert script_share("hello", "LATIN") == 1.0
    assert script_share("42 !", "ARABIC") is None


def test_answer_record_cuts_at_the_first_stop_id() -> None:
    rec = answer_record([10, 11, 1, 12, 2, 13], {2}, SPECIAL, decode)
    assert rec == {
        "turn_ended": True,
        "tokens": 5,  # four tokens and the stop token
        "special_tokens": ["<|im_end|>", "<|im_start|>"],
        "text": "مرحبا بكم hello",  # the special tokens are not text
    }
    rec = answer_record([12, 13, 12], {2}, SPECIAL, decode)
    assert rec == {"turn_ended": False, "tokens": 3, "special_tokens": [], "text": " hello 42 hello"}


def test_summarise_and_compare_by_hand() -> None:
    base = summarise(
        {
            "ar": [
                answer_record([10, 11, 2], {2}, SPECIAL, decode),  # all Arabic, ended after 3
                answer_record([10, 12, 12], {2}, SPECIAL, decode),  # 5 Arabic / 15 letters, not ended
            ],
            "en": [answer_record([12, 2], {2}, SPECIAL, decode)],
        }
    )
    assert base["ar"] == {"turn_ended": 0.5, "mean_tokens": 3.0, "script_share": pytest.approx((1 + 5 / 15) / 2)}
    assert base["en"] == {"turn_ended": 1.0, "mean_tokens": 2.0, "script_share": 1.0}
    assert base["special_tokens"] == ["<|im_end|>"]
    other = summarise(
        {
            "ar": [answer_record([12, 0], {0, 2}, SPECIAL, decode), answer_record([10, 2], {0, 2}, SPECIAL, decode)],
            "en": [answer_record([12, 12], {2}, SPECIAL, decode)],
        }
    )
    assert other["ar"]["turn_ended"] == 1.0 and other["ar"]["script_share"] == pytest.approx(0.5)
    assert compare(base, other) == {
        "same_special_tokens": False,  # ended one turn with <|endoftext|>
        "ar_turn_ended_not_worse": True,
        "ar_script_share_within_0.1": False,  # 0.5 against 0.667
        "en_turn_ended_not_worse": False,
        "en_script_share_within_0.1": True,
    }


def test_evaluate_on_a_tiny_chat_model(tmp_path: Path) -> None:
    """A real greedy run: the record agrees with transformers' own generate on the same prompt."""
    import torch
    from transformers import AutoTokenizer

    from tests.serve.conftest import make_model
    from tokenizer_ext import chat_quality

    model_dir = make_model(tmp_path / "m")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"
    out = chat_quality.evaluate(model, tok, ["en", "xx"], max_new_tokens=5)
    assert set(out["answers"]) == {"en"}  # no questions in an unknown language
    first = out["answers"]["en"][0]
    ids = tok.apply_chat_template(
        [{"role": "user", "content": first["question"]}], add_generation_prompt=True, return_dict=False
    )
    stops = chat_quality.stop_ids(tok, model)
    ref = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, eos_token_id=sorted(stops))
    new = ref[0, len(ids) :].tolist()
    assert first["tokens"] == len(new) and first["turn_ended"] == bool(stops & set(new))
