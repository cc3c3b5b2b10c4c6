"""tokenizer_ext.adapt: QLoRA end to end, embeddings mode, resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tokenizer_ext.conftest import make_ctx, tiny_llama
from tokenizer_ext import adapt
from tokenizer_ext.stages import AdaptParams
from warsha.training import TrainParams

TINY = dict(steps=2, batch_size=2, seq_len=32, lr=5e-3, warmup_steps=1, checkpoint_every=1, log_every=1)


def _state(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return {k: v.detach().float() for k, v in AutoModelForCausalLM.from_pretrained(path).state_dict().items()}


def test_qlora_trains_only_new_rows(tmp_path: Path, sp_embedded_dir: Path, corpus: Any) -> None:
    from transformers import AutoTokenizer

    ctx = make_ctx(tmp_path, sp_embedded_dir, corpus, "adapt")
    p = AdaptParams(
        domain_eval=[],
        train=TrainParams(**{**TINY, "steps": 1, "eval_every": 1, "bf16": True}),
        compare_base=False,
        eval_docs=1,
        eval_max_length=32,
        gen_tokens=0,
        train_docs=20,
    )
    m = adapt.run(ctx, p)
    curve = m["extended"]["bits_per_char_curve"]
    assert [c["step"] for c in curve] == [0, 1] and all(c["ar"] > 0 and c["en"] > 0 for c in curve)
    assert curve[-1]["ar"] != m["extended"]["bits_per_char"]["ar"]  # the NF4 model, then the merged one
    assert (ctx.out_dir / "adapter" / "adapter_config.json").is_file()
    tok = AutoTokenizer.from_pretrained(ctx.out_dir)
    n_new = len(tok) - 32000
    before, after = _state(sp_embedded_dir), _state(ctx.out_dir)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        torch.testing.assert_close(after[key][:32000], before[key][:32000])  # base rows frozen
        changed = (after[key][32000 : 32000 + n_new] != before[key][32000 : 32000 + n_new]).any(1)
        assert changed.sum() > 0.5 * n_new
        torch.testing.assert_close(after[key][32000 + n_new :], before[key][32000 + n_new :])
    # LoRA (B starts at zero, so one step moves it) is merged into the linear layers
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(after[q], before[q])
    assert m["extended"]["trainable_new_rows"] == n_new and "base_same_budget" not in m
    leak = m["extended"]["script_leak"]
    assert 0.0 <= leak["mean"] <= 1.0 and leak["positions"] > 0


def test_compare_base_scores_every_model(
    tmp_path: Path, sp_embedded_dir: Path, sp_model_dir: Path, corpus: Any
) -> None:
    """With compare_base the base adapted on the same budget and the unadapted base are scored
    like the extended model: bits/char, script leak, and the targets computed from them."""
    ctx = make_ctx(tmp_path, sp_embedded_dir, corpus, "adapt", base=sp_model_dir)
    p = AdaptParams(
        domain_eval=[],
        train=TrainParams(**{**TINY, "steps": 1}),
        eval_docs=1,
        eval_max_length=32,
        gen_tokens=0,
        train_docs=20,
    )
    m = adapt.run(ctx, p)
    for name in ("extended", "base_same_budget", "base_model"):
        assert set(m[name]["bits_per_char"]) == {"ar", "en"}, name
        assert 0.0 <= m[name]["script_leak"]["mean"] <= 1.0 and m[name]["script_leak"]["positions"] > 0, name
    assert "ar_bpc_extended_le_base_adapted" in m["targets"]


def test_lora_initialisation_follows_the_seed_not_the_process(sp_embedded_dir: Path) -> None:
    """Two loads with the same seed start from the same adapter whatever was drawn before them;
    another seed starts elsewhere (peft draws LoRA's A matrices from torch's global generator)."""
    from tokenizer_ext import qlora

    def lora_a(seed: int, draws: int) -> dict[str, torch.Tensor]:
        torch.rand(draws)  # what earlier work in the process consumed
        model = qlora.load(sp_embedded_dir, [32000], False, 4, 8, 0.0, False, False, bf16=False, seed=seed)
        return {n: q.detach().clone() for n, q in model.named_parameters() if "lora_A" in n}

    first, again, other = lora_a(7, 1), lora_a(7, 1000), lora_a(8, 1)
    assert first and first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not any(torch.equal(first[n], other[n]) for n in first)


@pytest.mark.slow
def test_qlora_same_budget_comparison(tmp_path: Path, sp_embedded_dir: Path, corpus: Any) -> None:
    ctx = make_ctx(tmp_path, sp_embedded_dir, corpus, "adapt")
    p = AdaptParams(
        domain_eval=[], train=TrainParams(**TINY), eval_docs=2, eval_max_length=32, gen_tokens=4, train_docs=40
    )
    m = adapt.run(ctx, p)
    ext, ctl = m["extended"], m["base_same_budget"]
    assert ext["trainable_new_rows"] > 0 and ctl["trainable_new_rows"] == 0
    assert ext["steps_run"] == ctl["steps_run"] == 2
    assert set(ext["bits_per_char"]) == {"ar", "en"} and ext["generation"]["chars_per_s"] > 0
    assert set(m["targets"]) == {
        "ar_bpc_extended_le_base_adapted",
        "ar_bpc_change_vs_base_model",
        "ar_bpc_at_most_5pct_worse",
        "en_bpc_change_vs_base_model",
        "en_bpc_at_most_5pct_worse",
    }
    logged = {k for row, _ in ctx.tracker.rows for k in row}
    assert {"adapt_extended/loss", "adapt_base/loss", "adapt_extended/tokens_per_s"} <= logged


def test_embeddings_mode_and_resume(tmp_path: Path, sp_embedded_dir: Path, corpus: Any) -> None:
    """Only embedding and LM head change; a rerun resumes from the saved checkpoint."""
    ctx = make_ctx(tmp_path, sp_embedded_dir, corpus, "adapt")
    p = AdaptParams(
        domain_eval=[],
        mode="embeddings",
        train=TrainParams(**{**TINY, "steps": 3, "eval_every": 3}),
        compare_base=False,
        eval_docs=2,
        eval_max_length=32,
        gen_tokens=0,
        train_docs=40,
    )
    first = adapt.run(ctx, p)["extended"]
    assert first["resumed_from_step"] == 0 and len(first["loss_curve"]) == 3
    curve = first["bits_per_char_curve"]  # the trained weights are the final model's: scored once, at the end
    assert [c["step"] for c in curve] == [0, 3] and curve[-1]["ar"] == first["bits_per_char"]["ar"]
    before, after = _state(sp_embedded_dir), _state(ctx.out_dir)
    for key in before:
        same = torch.equal(before[key], after[key])
        assert same == (key not in ("model.embed_tokens.weight", "lm_head.weight")), key
    again = adapt.run(ctx, p)["extended"]
    assert again["resumed_from_step"] == 2 and len(again["loss_curve"]) == 1


@pytest.mark.slow
def test_qlora_full_embeddings_option(tmp_path: Path, sp_embedded_dir: Path, corpus: Any) -> None:
    """modules_to_save trains whole matrices: base rows move too."""
    ctx = make_ctx(tmp_path, sp_embedded_dir, corpus, "adapt")
    p = AdaptParams(
        domain_eval=[],
        train=TrainParams(**{**TINY, "steps": 1}),
        full_embeddings=True,
        compare_base=False,
        eval_docs=1,
        eval_max_length=32,
        gen_tokens=0,
        train_docs=20,
    )
    m = adapt.run(ctx, p)
    before, after = _state(sp_embedded_dir), _state(ctx.out_dir)
    key = "model.embed_tokens.weight"
    assert not torch.equal(after[key][:32000], before[key][:32000])
    assert m["extended"]["trainable_params"] > 2 * 32000 * 64


@pytest.mark.parametrize("new_scale", [1.0, 0.0])
def test_full_embeddings_with_frozen_base_rows(
    tmp_path: Path, sp_embedded_dir: Path, corpus: Any, new_scale: float
) -> None:
    """base_rows_lr_scale 0 keeps the base vocabulary's rows where they were while the new rows
    and LoRA train: the hook reaches the optimizer adapt builds, and the merged model keeps it.
    float32 throughout: a bf16 compute dtype would round the trained copy of the matrix."""
    ctx = make_ctx(tmp_path, sp_embedded_dir, corpus, "adapt")
    p = AdaptParams(
        domain_eval=[],
        train=TrainParams(**{**TINY, "steps": 2, "bf16": False}),
        full_embeddings=True,
        base_rows_lr_scale=0.0,
        new_rows_lr_scale=new_scale,
        compare_base=False,
        eval_docs=1,
        eval_max_length=32,
        gen_tokens=0,
        train_docs=20,
    )
    adapt.run(ctx, p)
    before, after = _state(sp_embedded_dir), _state(ctx.out_dir)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):  # untied: both matrices train
        torch.testing.assert_close(after[key][:32000], before[key][:32000], rtol=0, atol=0)
    moved = (after["lm_head.weight"][32000:] != before["lm_head.weight"][32000:]).any(1)
    assert moved.all() if new_scale else not moved.any()  # new_rows_lr_scale 0 holds the new rows too


def test_base_rows_lr_scale_needs_full_embeddings() -> None:
    problems = AdaptParams(base_rows_lr_scale=0.1).validate()
    assert any(q.startswith("base_rows_lr_scale: needs full_embeddings") for q in problems)
    assert AdaptParams(base_rows_lr_scale=0.1, full_embeddings=True).validate() == []
    assert any(q.startswith("new_rows_lr_scale: needs") for q in AdaptParams(new_rows_lr_scale=0.3).validate())


def test_qlora_full_embeddings_train_a_tied_head(tmp_path: Path) -> None:
    """On a tied model the head trains with the embedding: after a step the logits are the
    last hidden state times the trained matrix, and the merged model shares that one matrix
    (peft would otherwise train a copy of the embedding while the head kept the original)."""
    from tokenizer_ext import qlora

    src = tmp_path / "tied"
    original = tiny_llama(src, 320, tie=True).get_input_embeddings().weight.detach().clone()
    model = qlora.load(src, [], True, 4, 8, 0.0, False, True, seed=0)
    torch.manual_seed(0)
    ids = torch.randint(0, 320, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=1.0).step()
    trained = model.get_input_embeddings().modules_to_save["default"].weight.detach()
    assert not torch.equal(trained, original)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(out.logits, out.hidden_states[-1] @ trained.T)
    merged = qlora.save_and_merge(model, src, tmp_path / "adapter")
    assert merged.get_output_embeddings().weight.data_ptr() == merged.get_input_embeddings().weight.data_ptr()
    torch.testing.assert_close(merged.get_input_embeddings().weight.detach(), trained)


def test_targets_count_improvement_as_met() -> None:
    """English 13% better than the base is not a miss; Arabic 6% worse is."""
    m = {
        "extended": {"bits_per_char": {"ar": 1.06, "en": 0.87}},
        "base_same_budget": {"bits_per_char": {"ar": 1.10, "en": 0.90}},
        "base_model": {"bits_per_char": {"ar": 1.0, "en": 1.0}},
    }
    t = adapt.targets(m)
    assert t["ar_bpc_extended_le_base_adapted"] is True
    assert t["ar_bpc_change_vs_base_model"] == pytest.approx(0.06)
    assert t["ar_bpc_at_most_5pct_worse"] is False
    assert t["en_bpc_change_vs_base_model"] == pytest.approx(-0.13)
    assert t["en_bpc_at_most_5pct_worse"] is True


def test_replay_lora_layers_and_other_domains(
    tmp_path: Path, sp_embedded_dir: Path, sp_model_dir: Path, corpus: Any
) -> None:
    """Replay: the base writes one sequence per replay row of every step (languages alternating),
    kept beside the checkpoints; LoRA on layer 1 only leaves layer 0 as it was; every model is
    scored on the other-domain sets, paired against the unadapted base."""
    ctx = make_ctx(tmp_path, sp_embedded_dir, corpus, "adapt", base=sp_model_dir)
    p = AdaptParams(
        train=TrainParams(**{**TINY, "batch_size": 4}),
        replay_fraction=0.5,
        replay_top_k=4,
        lora_layers=[1],
        eval_docs=1,
        eval_max_length=32,
        gen_tokens=0,
        train_docs=20,
        domain_eval=["ar_msa"],
        domain_docs=2,
    )
    m = adapt.run(ctx, p)
    assert m["replay"]["sequences"] == 2 * 2 and m["replay"]["languages"] == {"ar": 2, "en": 2}
    assert (ctx.checkpoint_dir / "replay.pt").is_file()
    report = m["other_domains"]
    assert set(report["bits_per_char"]) == {"extended", "base_same_budget", "base_model"}
    assert set(report["change_vs_base_model"]) == {"extended", "base_same_budget"}
    before, after = _state(sp_embedded_dir), _state(ctx.out_dir)
    layer = "model.layers.{}.self_attn.q_proj.weight"
    assert torch.equal(before[layer.format(0)], after[layer.format(0)])
    assert not torch.equal(before[layer.format(1)], after[layer.format(1)])


def test_replay_options_are_checked() -> None:
    small = AdaptParams(train=TrainParams(batch_size=2), replay_fraction=0.1)
    assert any("is no sequence" in q for q in small.validate())
    assert any(
        "no corpus sequence" in q for q in AdaptParams(train=TrainParams(batch_size=2), replay_fraction=0.9).validate()
    )
    assert any("lora_layers" in q for q in AdaptParams(mode="full", lora_layers=[0]).validate())
    assert any("replay_as_text" in q for q in AdaptParams(replay_as_text=True).validate())
    assert not AdaptParams(replay_as_text=True, replay_fraction=0.25).validate()
    from tokenizer_ext.stages import EmbedParams

    fit = TrainParams(batch_size=4)
    assert any("fit_replay_fraction" in q for q in EmbedParams(fit=fit, fit_replay_fraction=0.1).validate())
    assert any("no corpus sequence" in q for q in EmbedParams(fit=fit, fit_replay_fraction=0.9).validate())
    assert not EmbedParams(fit=fit, fit_replay_fraction=0.5).validate()


@pytest.fixture(scope="module")
def trained_embedded(tmp_path_factory: pytest.TempPathFactory, trained_base: Path, corpus: Any) -> Path:
    """``embed`` (subword mean) over the trained base: where the distillation tests start."""
    from tokenizer_ext import embed
    from tokenizer_ext.stages import EmbedParams

    ctx = make_ctx(tmp_path_factory.mktemp("trained_embedded"), trained_base, corpus, "embed")
    embed.run(ctx, EmbedParams(eval_docs=0, domain_eval=[]))
    return ctx.out_dir


def _distance_to_base(model_dir: Path, base_dir: Path, corpus: Any) -> float:
    """Held-out cross-tokenizer distillation loss of a saved model against its base."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenizer_ext import cross_tok, embed

    ext_tok, base_tok = (
        AutoTokenizer.from_pretrained(model_dir),
        AutoTokenizer.from_pretrained(base_dir / "base_tokenizer"),
    )
    windows = cross_tok.sample_windows(corpus.texts("ar", "validation")[:30], 8, ext_tok, base_tok, 48, seed=9)
    batch = cross_tok.collate(windows, 0)
    firsts = cross_tok.first_pieces(embed.base_splits(model_dir, 32000, len(ext_tok)))
    teacher = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return float(cross_tok.loss_fn(teacher, firsts, 32000, 8, 1.0, nll_weight=0.0)(model, batch))


def test_distillation_holds_the_extended_model_to_its_base(
    tmp_path: Path, trained_embedded: Path, trained_base: Path, corpus: Any
) -> None:
    """The same budget with the cross-tokenizer term ends nearer the base than without it."""
    train = TrainParams(**{**TINY, "steps": 8, "batch_size": 4, "lr": 2e-2})
    distance = {}
    for weight in (0.0, 3.0):
        ctx = make_ctx(tmp_path, trained_embedded, corpus, f"adapt{weight}")
        p = AdaptParams(
            train=train,
            distill_weight=weight,
            distill_top_k=8,
            compare_base=False,
            eval_docs=1,
            eval_max_length=32,
            gen_tokens=0,
            train_docs=40,
            domain_eval=[],
            chat_tokens=0,
        )
        adapt.run(ctx, p)
        distance[weight] = _distance_to_base(ctx.out_dir, trained_base, corpus)
    assert distance[3.0] < 0.95 * distance[0.0], distance


def test_distillation_with_replay_and_the_same_budget_base(
    tmp_path: Path, trained_embedded: Path, trained_base: Path, corpus: Any
) -> None:
    """Both runs take the term (the base's tokens align one to one with its own); replay mixes in."""
    ctx = make_ctx(tmp_path, trained_embedded, corpus, "adapt", base=trained_base)
    p = _replay_params(distill_weight=1.0, distill_top_k=4, replay_fraction=0.25)
    m = adapt.run(ctx, p)
    assert m["extended"]["steps_run"] == m["base_same_budget"]["steps_run"] == 2
    assert all(torch.isfinite(torch.tensor(m[k]["loss_curve"])).all() for k in ("extended", "base_same_budget"))
    assert any(
        "distill_weight" in q for q in AdaptParams(distill_weight=1.0, mode="full", deepspeed="x.json").validate()
    )


def test_replay_as_text_shows_the_extended_model_its_new_pieces(
    tmp_path: Path, trained_embedded: Path, trained_base: Path, corpus: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``replay_as_text``: each run reads the base-written sequences through its own tokenizer,
    so the extended run's replay windows hold new pieces (read as base ids they never would) and
    the same-budget base run's hold none; both train against the base and finish."""
    from tokenizer_ext import cross_tok

    seen: list[torch.Tensor] = []
    real = cross_tok.collate

    def spy(windows: Any, pad: int) -> dict[str, torch.Tensor]:
        batch = real(windows, pad)
        seen.append(batch["input_ids"])
        return batch

    monkeypatch.setattr(cross_tok, "collate", spy)
    ctx = make_ctx(tmp_path, trained_embedded, corpus, "adapt", base=trained_base)
    p = _replay_params(replay_fraction=0.5, replay_as_text=True)
    m = adapt.run(ctx, p)
    assert m["extended"]["steps_run"] == m["base_same_budget"]["steps_run"] == 2
    assert all(torch.isfinite(torch.tensor(m[k]["loss_curve"])).all() for k in ("extended", "base_same_budget"))
    assert len(seen) == 4 and all(ids.shape[0] == 2 for ids in seen)  # two replay windows per step, two runs
    base_n = 32000
    assert any((ids >= base_n).any() for ids in seen[:2])  # the extended run reads new pieces
    assert not any((ids >= base_n).any() for ids in seen[2:])  # the base run cannot


def _replay_params(**kw: Any) -> AdaptParams:
    """Two tiny steps of 4 sequences with replay, scored on one document: what the replay tests vary."""
    fixed: dict[str, Any] = dict(replay_top_k=4, eval_docs=1, eval_max_length=32, gen_tokens=0, train_docs=20)
    return AdaptParams(train=TrainParams(**{**TINY, "batch_size": 4}), domain_eval=[], **{**fixed, **kw})


def test_lora_on_the_unquantized_base(tmp_path: Path, sp_embedded_dir: Path, corpus: Any) -> None:
    """``quantize_base: false``: the adapter trains on the float32 weights it is merged into, so
    the curve at step 0 (LoRA's B is zero) is the unquantized model's bits/char, which the NF4
    base does not give."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenizer_ext import quality

    tok = AutoTokenizer.from_pretrained(sp_embedded_dir)
    plain = AutoModelForCausalLM.from_pretrained(sp_embedded_dir, dtype=torch.float32)
    want = quality.bits_per_char(plain, tok, corpus, 2, 32, set_eval=False)["ar"]
    step0 = {}
    for quantize in (False, True):
        ctx = make_ctx(tmp_path, sp_embedded_dir, corpus, f"adapt{quantize}")
        train = TrainParams(**{**TINY, "steps": 1, "eval_every": 1, "bf16": False})
        p = AdaptParams(domain_eval=[], train=train, compare_base=False, eval_docs=2, eval_max_length=32,
                        gen_tokens=0, train_docs=20, quantize_base=quantize)  # fmt: skip
        step0[quantize] = adapt.run(ctx, p)["extended"]["bits_per_char_curve"][0]["ar"]
    assert step0[False] == pytest.approx(want, rel=1e-5)
    assert abs(step0[True] - want) > 1e-4 * want
