"""Passkey prompts, scoring and intervals, against generate() and scipy; the data splits."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from context_ext import longdata, passkey
from warsha import synthetic
from warsha.lm_loss import weighted_lm_loss


@pytest.fixture(scope="module")
def tok_and_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """The bootstrap's Llama 32k tokenizer and a tiny random Llama."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from warsha.bootstrap import tokenizer_file
    from warsha.sentencepiece_hf import sp_model_to_hf

    d = tmp_path_factory.mktemp("tok")
    sp_model_to_hf(tokenizer_file("mistral-common:tokenizer.model.v1"), d)
    tok = AutoTokenizer.from_pretrained(d)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    return tok, LlamaForCausalLM(cfg).eval()


def test_key_sets_are_disjoint_and_cover_all_keys() -> None:
    rng = random.Random(0)
    train = {passkey.draw_key(rng, "train") for _ in range(3000)}
    evals = {passkey.draw_key(rng, "eval") for _ in range(3000)}
    assert not train & evals
    assert all(len(k) == 5 for k in train | evals)
    share = sum(passkey.key_split(k) == "eval" for k in range(10000, 100000)) / 90000
    assert 0.2 < share < 0.3
    # no digit rule separates them: every last digit occurs in both sets
    assert {k[-1] for k in train} == {k[-1] for k in evals} == set("0123456789")


def test_training_depths_avoid_evaluation_depths() -> None:
    rng = random.Random(1)
    depths = [passkey.train_depth(rng) for _ in range(2000)]
    assert min(abs(d - e) for d in depths for e in passkey.EVAL_DEPTHS) >= passkey.DEPTH_MARGIN
    assert min(depths) < 0.1 and max(depths) > 0.9


def test_sample_layout(tok_and_model: tuple[Any, Any]) -> None:
    tok, _ = tok_and_model
    fmt = passkey.PasskeyFormat(tok)
    filler = passkey.filler_stream(tok, ["Narrated Abu Huraira: the Prophet said something long. " * 20])
    for length, depth in ((200, 0.1), (333, 0.5), (512, 0.9)):
        s = passkey.make_sample(fmt, filler, length, depth, random.Random(length), "eval")
        assert len(s.input_ids) == length
        assert passkey.key_split(int(s.key)) == "eval"
        assert tok.decode(s.input_ids[-s.answer_len :]).strip() == s.key
        needle = fmt.needle_ids(s.key)
        at = next(i for i in range(length) if s.input_ids[i : i + len(needle)] == needle)
        n_fill = length - fmt.overhead(s.key)
        assert at - 1 == round(depth * n_fill)
        prompt = tok.decode(s.input_ids[: -s.answer_len])
        assert prompt.endswith(passkey.QUESTION)


def test_greedy_hits_equal_generate(tok_and_model: tuple[Any, Any]) -> None:
    """Teacher-forced scoring agrees with greedy generate(), for hits and misses alike."""
    tok, model = tok_and_model
    fmt = passkey.PasskeyFormat(tok)
    filler = passkey.filler_stream(tok, ["some filler text with words in it. " * 30])
    rng = random.Random(3)
    for trial in range(6):
        s = passkey.make_sample(fmt, filler, 96, 0.5, rng, "eval")
        prompt = torch.tensor([s.input_ids[: -s.answer_len]])
        with torch.inference_mode():
            gen = model.generate(prompt, max_new_tokens=s.answer_len, do_sample=False, pad_token_id=0)
        generated = gen[0, prompt.shape[1] :].tolist()
        # a sample whose "key" is what greedy decoding produces must be a hit ...
        forced = passkey.Sample(s.input_ids[: -s.answer_len] + generated, s.answer_len, s.depth, s.key)
        # ... and changing any one of its tokens must make it a miss
        wrong = list(forced.input_ids)
        wrong[-1 - trial % s.answer_len] = (wrong[-1 - trial % s.answer_len] + 1) % len(tok)
        miss = passkey.Sample(wrong, s.answer_len, s.depth, s.key)
        assert passkey.greedy_hits(model, [forced, miss, s]) == [True, False, generated == s.input_ids[-s.answer_len :]]


def test_wilson_matches_scipy() -> None:
    from scipy.stats import binomtest

    for k, n in ((0, 40), (40, 40), (20, 40), (37, 100), (1, 7)):
        ref = binomtest(k, n).proportion_ci(0.95, method="wilson")
        low, high = passkey.wilson(k, n)
        assert low == pytest.approx(ref.low, abs=1e-3) and high == pytest.approx(ref.high, abs=1e-3)


def test_trials_stop_when_interval_is_narrow(tok_and_model: tuple[Any, Any]) -> None:
    tok, model = tok_and_model
    fmt = passkey.PasskeyFormat(tok)
    filler = passkey.filler_stream(tok, ["filler words here and there. " * 30])
    cell = passkey.evaluate_length(model, fmt, filler, 64, min_trials=20, max_trials=200, half_width=0.05, batch_size=8)
    low, high = passkey.wilson(cell.hits, cell.trials)
    assert cell.trials <= 200
    assert (high - low) / 2 <= 0.05 or cell.trials == 200
    assert cell.trials >= 20 and cell.trials % len(passkey.EVAL_DEPTHS) == 0
    again = passkey.evaluate_length(
        model, fmt, filler, 64, min_trials=20, max_trials=200, half_width=0.05, batch_size=8
    )
    assert again == cell  # the same prompts every time: methods are compared on identical samples


def test_training_batches_use_train_keys_and_are_reproducible(tok_and_model: tuple[Any, Any], corpus: Any) -> None:
    tok, _ = tok_and_model
    batches = longdata.make_batches(tok, corpus, "en", 128, 4, 1.0, seed=5, answer_weight=3.0)
    first, again = batches(7, 0, 0), batches(7, 0, 0)
    assert torch.equal(first["input_ids"], again["input_ids"])
    assert first["input_ids"].shape == (4, 128)
    fmt = passkey.PasskeyFormat(tok)
    q = fmt.question_ids
    for row, w in zip(first["input_ids"].tolist(), first["loss_weights"]):
        tail = tok.decode(row[-6:]).strip()
        assert passkey.key_split(int(tail)) == "train"
        assert row[-6 - len(q) : -6] == q
        assert w[-6:].tolist() == [3.0] * 6
        # outside the answer only the key's second mention in the needle is scored (4 digits)
        marked = [i for i in range(128 - 6) if w[i] > 0]
        assert len(marked) == 4 and [row[i] for i in marked] == row[-4:]
    heldout = set(longdata.heldout_texts(corpus, "en"))
    assert not heldout & set(longdata.train_texts(corpus, "en"))


def test_weighted_loss_with_unit_weights_is_the_causal_lm_loss(tok_and_model: tuple[Any, Any]) -> None:
    _, model = tok_and_model
    ids = torch.randint(0, 1000, (2, 40))
    batch = {"input_ids": ids, "loss_weights": torch.ones(2, 40)}
    ref = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(weighted_lm_loss(model, batch), ref)
    batch["loss_weights"][:, -5:] = 4.0
    assert not torch.allclose(weighted_lm_loss(model, batch), ref)


def test_long_documents_reach_the_length(tok_and_model: tuple[Any, Any], corpus: Any) -> None:
    tok, _ = tok_and_model
    docs = longdata.long_documents(tok, longdata.heldout_texts(corpus, "en"), 2, 1000)
    assert len(docs) == 2
    assert all(len(tok(d, add_special_tokens=False)["input_ids"]) >= 1000 for d in docs)
    with pytest.raises(ValueError, match="ppl_documents"):
        longdata.long_documents(tok, ["short text"], 2, 1000)


def test_repeat_rows_mark_only_copyable_targets() -> None:
    rng = random.Random(5)
    filler = [rng.randrange(3, 1000) for _ in range(5000)]
    for length in (64, 256, 1024):
        ids, w = synthetic.repeat_row(filler, length, random.Random(length), 1)
        assert len(ids) == len(w) == length and ids[0] == 1
        marked = [i for i, x in enumerate(w) if x > 0]
        assert len(marked) > length // 2
        span = next(s for s in range(1, length) if ids[1 : 1 + s] == ids[1 + s : 1 + 2 * s][:s])
        for i in marked:  # each target and its predecessor occurred one span earlier
            assert ids[i] == ids[i - span] and ids[i - 1] == ids[i - 1 - span]


def test_curriculum_doubles_length_with_constant_tokens(tok_and_model: tuple[Any, Any], corpus: Any) -> None:
    tok, _ = tok_and_model
    b = longdata.make_batches(
        tok,
        corpus,
        "en",
        1024,
        2,
        0.4,
        0,
        copy_fraction=0.4,
        start_len=256,
        steps=100,
        curriculum=0.6,
        lm_positions=0.5,
        max_stream_tokens=200_000,
    )
    lengths = [b.length_at(s) for s in range(100)]
    assert lengths[0] == 256 and lengths[-1] == 1024 and sorted(lengths) == lengths
    assert set(lengths) == {256, 512, 1024} and lengths.index(1024) == 60
    for step in (0, 30, 99):
        batch = b(step, 0, 0)
        assert batch["input_ids"].shape == (b.rows_at(step), b.length_at(step))
        assert batch["input_ids"].numel() == 2 * 1024
        assert torch.equal(batch["input_ids"], b(step, 0, 0)["input_ids"])  # pure function of the step


def test_weighted_loss_on_selected_targets_matches_full_logits(tok_and_model: tuple[Any, Any]) -> None:
    """Running the LM head only where weights are non-zero gives the full-logit loss."""
    _, model = tok_and_model
    ids = torch.randint(0, 1000, (3, 40))
    weights = (torch.rand(3, 40) < 0.3).float() * torch.randint(1, 4, (3, 40))
    weights[0, -3:] = 5.0
    logits = model(input_ids=ids).logits[:, :-1].double()
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none"
    )
    w = weights[:, 1:].reshape(-1).double()
    ref = (nll * w).sum() / w.sum()
    got = weighted_lm_loss(model, {"input_ids": ids, "loss_weights": weights})
    assert float(got.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)


def test_source_fraction_mixes_the_other_languages_train_text(tok_and_model: tuple[Any, Any], corpus: Any) -> None:
    """``source_fraction`` of the corpus tokens come from the other language's train split."""
    import re

    tok, _ = tok_and_model
    plain = longdata.make_batches(tok, corpus, "ar", 64, 2, 0.0, seed=1, max_stream_tokens=3000)
    mixed = longdata.make_batches(
        tok, corpus, "ar", 64, 2, 0.0, seed=1, max_stream_tokens=3000, source_lang="en", source_fraction=0.4
    )

    def latin_share(ids: Any) -> float:
        text = tok.decode(ids.tolist())
        letters = re.findall(r"[A-Za-z\u0600-\u06FF]", text)
        return sum(c.isascii() for c in letters) / max(len(letters), 1)

    assert latin_share(plain.stream) < 0.05
    n_ar = len(mixed.stream) - int(3000 * 0.4)
    assert torch.equal(mixed.stream[:n_ar], plain.stream[:n_ar])  # the target text is the same
    assert latin_share(mixed.stream[n_ar:]) > 0.95
    assert len(mixed.stream) == len(plain.stream)
    same = longdata.make_batches(
        tok, corpus, "ar", 64, 2, 0.0, seed=1, max_stream_tokens=3000, source_lang="ar", source_fraction=0.4
    )
    assert torch.equal(same.stream, plain.stream)  # the target language is not its own source


def test_other_language_check_scores_the_requested_tokens(tok_and_model: tuple[Any, Any], corpus: Any) -> None:
    """The other language's short-context ratio is read from enough text to mean something."""
    from context_ext.stages import YarnParams
    from context_ext.yarn_stage import eval_data, resolve
    from tests.context_ext.test_scaling import llama_config_dict

    tok, _ = tok_and_model
    plan = resolve(llama_config_dict(max_pos=64), YarnParams(factor=2.0, baselines=[], finetune_baselines=[]))
    data = eval_data(tok, corpus, "ar", plan, 1, "en", source_tokens=3000)
    assert len(tok(data.source_texts[0], add_special_tokens=False)["input_ids"]) >= 3000
    with pytest.raises(ValueError, match="short_eval_tokens"):
        eval_data(tok, corpus, "ar", plan, 1, "en", source_tokens=10**9)
