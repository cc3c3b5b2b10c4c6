"""The context_ext.yarn stage through the real pipeline, on the tiny bootstrap model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from context_ext import scaling
from tests.conftest import tiny_recipe
from tests.context_ext.conftest import llama_config_dict, make_ctx

FAST = {
    "factor": 2.0,
    "steps": 3,
    "batch_size": 2,
    "checkpoint_every": 2,
    "bf16": False,
    "lr": 1e-3,
    "min_trials": 10,
    "max_trials": 10,
    "eval_multiples": [1.0, 2.0, 4.0],
    "ppl_documents": 1,
    "baselines": ["none", "ntk"],
    "finetune_baselines": ["linear"],
    "lang": "en",
    "source_fraction": 0.3,
}


def _run(root: Path, base: Path, params: dict[str, Any]) -> Path:
    from warsha import pipeline
    from warsha.config import parse_recipe

    raw = tiny_recipe()
    raw["base"] = str(base)
    raw["stages"] = [{"stage": "context_ext.yarn", "params": params}]
    recipe = parse_recipe(raw)
    steps = pipeline.plan(recipe, root)
    pipeline.Runner(recipe, root).run(steps, {0})
    return root / "yarn"


@pytest.fixture(scope="module")
def extended(tmp_path_factory: pytest.TempPathFactory, tiny_artifact: Path) -> Path:
    """The tiny bootstrap model (context 64) extended 2x through the pipeline."""
    return _run(tmp_path_factory.mktemp("ctx-run"), tiny_artifact, FAST)


def test_output_loads_and_generates_with_transformers(extended: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from serve import rope

    model = AutoModelForCausalLM.from_pretrained(extended).eval()
    tok = AutoTokenizer.from_pretrained(extended)
    cfg = json.loads((extended / "config.json").read_text())
    assert cfg["rope_parameters"] == {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    }
    assert cfg["max_position_embeddings"] == 128 and "rope_scaling" not in cfg
    assert json.loads((extended / "tokenizer_config.json").read_text())["model_max_length"] == 128
    emb = model.model.rotary_emb
    inv, scale = rope.yarn(16, 10000.0, 2.0, 64)
    torch.testing.assert_close(emb.inv_freq.double(), inv, atol=1e-6, rtol=1e-6)
    assert emb.attention_scaling == pytest.approx(scale)
    ref, _ = ROPE_INIT_FUNCTIONS["yarn"](model.config, "cpu")
    torch.testing.assert_close(emb.inv_freq, ref)
    prompt = tok("The Prophet said " * 30, return_tensors="pt")  # longer than the original 64
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 8


def test_metrics_table_and_plot(extended: Path) -> None:
    from warsha import artifacts

    m = artifacts.read_manifest(extended)["metrics"]
    assert set(m["results"]) == {"none", "NTK", "YaRN+ft", "PI+ft"}
    assert m["lengths"] == [64, 128, 256] and m["short_lengths"] == [32, 64]
    for r in m["results"].values():
        for n in ("64", "128", "256"):
            cell = r["passkey"][n]
            assert cell["trials"] == 10 and 0 <= cell["ci95"][0] <= cell["accuracy"] <= cell["ci95"][1] <= 1
            assert r["perplexity"][n] > 1
    assert m["short_context_ratio"]["none"] == {"32": 1.0, "64": 1.0}
    other = m["short_context_ratio_other_language"]  # Arabic: the corpus's other language
    assert set(other) == set(m["results"]) and other["none"] == {"32": 1.0, "64": 1.0}
    assert all(0 < v < 10 for r in other.values() for v in r.values())
    assert m["train"]["YaRN+ft"]["steps_run"] == 3 and m["train"]["PI+ft"]["steps_run"] == 3
    assert m["written_config"]["inv_freq_max_abs_diff"] < 1e-6
    table = (extended / "context_ext.md").read_text()
    assert "| YaRN+ft |" in table and "| PI+ft |" in table and "passkey 4x (256)" in table
    assert "other language short ppl / none @64" in table
    assert (extended / "context_ext.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fine_tune_changes_weights_and_resumes_from_finished_copy(
    extended: Path, tiny_artifact: Path, tmp_path: Path, corpus: Any
) -> None:
    """A rerun in the same checkpoint dir reuses the finished fine-tune instead of retraining."""
    from transformers import AutoModelForCausalLM

    from context_ext.stages import YarnParams
    from context_ext.yarn_stage import finetune, resolve

    base = AutoModelForCausalLM.from_pretrained(tiny_artifact)
    tuned = AutoModelForCausalLM.from_pretrained(extended)
    assert not torch.equal(base.model.layers[0].mlp.up_proj.weight, tuned.model.layers[0].mlp.up_proj.weight)
    ctx = make_ctx(tmp_path, tiny_artifact, corpus)
    p = YarnParams(**{k: v for k, v in FAST.items()})
    plan = resolve(json.loads((tiny_artifact / "config.json").read_text()), p)

    def no_batches(*_: Any) -> Any:
        raise AssertionError("training ran again")

    done = ctx.checkpoint_dir / "final-yarn"
    tuned.save_pretrained(done)
    (done / "summary.json").write_text(json.dumps({"steps_run": 3}))
    model, summary = finetune(ctx, p, plan, "yarn", no_batches)
    assert summary == {"steps_run": 3}
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, tuned.model.layers[0].mlp.up_proj.weight)


def test_bad_inputs_fail_before_any_work(tmp_path: Path, corpus: Any) -> None:
    from transformers import GPT2Config

    from context_ext.stages import YarnParams
    from context_ext.yarn_stage import run

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2).to_dict()
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (gpt2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*no rotary position embeddings"):
        run(make_ctx(tmp_path, gpt2, corpus), YarnParams())
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    (scaled / "config.json").write_text(json.dumps(scaling.scaled_config(llama_config_dict(64), "yarn", 2.0)))
    with pytest.raises(ValueError, match="already scaled"):
        run(make_ctx(tmp_path, scaled, corpus), YarnParams())
    for path in (gpt2, scaled):
        assert not (path.parent / "out" / "checkpoints").exists()


def test_recipe_validation_reports_bad_params() -> None:
    from warsha.config import RecipeError, parse_recipe

    for params, problem in (
        ({"factor": 0.5}, "stages[1].params.factor: must be > 1.0, got 0.5"),
        (
            {"original_max_position_embeddings": 512, "target_length": 256},
            "stages[1].params.target_length: must be >= original_max_position_embeddings 512, got 256",
        ),
        ({"method": "rope"}, "stages[1].params.method: must be one of 'yarn' | 'linear' | 'ntk', got 'rope'"),
    ):
        raw = tiny_recipe()
        raw["stages"].append({"stage": "context_ext.yarn", "params": params})
        with pytest.raises(RecipeError) as err:
            parse_recipe(raw)
        assert problem in err.value.problems


def test_finetune_with_train_head_false_leaves_an_untied_head(tmp_path: Path, tiny_artifact: Path) -> None:
    from safetensors.torch import load_file

    params = FAST | {"train_head": False, "baselines": ["none"], "finetune_baselines": [], "eval_multiples": [1.0]}
    extended = _run(tmp_path, tiny_artifact, params)
    before, after = load_file(tiny_artifact / "model.safetensors"), load_file(extended / "model.safetensors")
    assert not json.loads((tiny_artifact / "config.json").read_text()).get("tie_word_embeddings", False)
    torch.testing.assert_close(after["lm_head.weight"], before["lm_head.weight"], atol=0, rtol=0)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(after[q], before[q])


def test_freeze_head_leaves_a_tied_head_trainable() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from context_ext.yarn_stage import freeze_head

    small = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    small |= {"num_attention_heads": 2, "num_key_value_heads": 1}
    untied = LlamaForCausalLM(LlamaConfig(**small, tie_word_embeddings=False))
    assert freeze_head(untied) and not untied.lm_head.weight.requires_grad
    assert untied.model.embed_tokens.weight.requires_grad
    tied = LlamaForCausalLM(LlamaConfig(**small, tie_word_embeddings=True))
    assert not freeze_head(tied) and tied.lm_head.weight.requires_grad


def test_finetune_trains_the_head_by_default(extended: Path, tiny_artifact: Path) -> None:
    from safetensors.torch import load_file

    before, after = load_file(tiny_artifact / "model.safetensors"), load_file(extended / "model.safetensors")
    assert not torch.equal(after["lm_head.weight"], before["lm_head.weight"])
