"""An instruct model keeps being one: its chat template and stop ids through every stage.

A tiny instruct-like model (the bootstrap model with a chat template and a list of stop ids)
goes import -> extend -> embed -> adapt -> yarn -> draft -> gptq/awq -> serve.validate through
the real pipeline (slow; the default suite runs import -> extend -> embed -> rtn). Every
artifact must hold the import's template (same sha256) and stop ids, each manifest must record
them, and serve's ``/v1/chat/completions`` must answer on the last artifact with the prompt the
template builds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import tiny_recipe
from warsha import tokenizer_files

# Mistral-style turns on the bootstrap tokenizer's own specials: </s> ends a turn.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
STOP_IDS = [2, 7]  # </s> and a second id only generation_config.json names
SMALL_TRAIN = {"steps": 2, "batch_size": 2, "seq_len": 32, "lr": 1e-3, "warmup_steps": 1, "bf16": False}


def instruct_source(tiny: Path, out: Path) -> Path:
    """The tiny bootstrap model as an HF directory with an inline chat template (the older
    tokenizer_config.json form) and two stop ids."""
    shutil.copytree(tiny, out, ignore=shutil.ignore_patterns("warsha.json"))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    gen = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": STOP_IDS}))
    return out


def stages(source: Path) -> list[dict[str, Any]]:
    """Every stage once, each as small as it runs."""
    quant = {"group_size": 32, "eval_documents": 4, "eval_max_length": 48, "n_samples": 4, "seq_len": 32}
    return [
        {"stage": "import", "params": {"source": {"path": str(source)}}},
        {"stage": "tokenizer_ext.extend", "params": {"vocab_size": 32100, "check_docs": 8}},
        {"stage": "tokenizer_ext.embed", "params": {"pad_to_multiple_of": 64, "eval_docs": 0}},
        {
            "stage": "tokenizer_ext.adapt",
            "inputs": {"base": "import"},
            "params": {
                "mode": "embeddings",
                "eval_docs": 2,
                "eval_max_length": 32,
                "gen_tokens": 0,
                "chat_tokens": 6,
                "train": SMALL_TRAIN,
            },
        },
        {
            "stage": "context_ext.yarn",
            "params": {
                **{"factor": 2.0, "steps": 1, "batch_size": 2, "bf16": False, "min_trials": 2, "max_trials": 2},
                **{"eval_multiples": [1.0], "ppl_documents": 1, "baselines": [], "finetune_baselines": []},
                **{"lang": "en", "short_multiples": [1.0], "short_eval_tokens": 256},
            },
        },
        {
            "stage": "distill.draft",
            "params": {
                **{"method": "layers", "layers": [0], "baseline": False, "eval_documents": 2, "eval_len": 32},
                **{
                    "spec_prompts": 1,
                    "spec_prompt_len": 8,
                    "spec_ks": [1],
                    "spec_temperatures": [0.0],
                    "spec_new_tokens": 4,
                },
                **{"max_train_documents": 40, "train": SMALL_TRAIN},
            },
        },
        {"stage": "quantize.rtn", "params": {"group_size": 32, "eval_documents": 4, "eval_max_length": 48}},
        {"stage": "quantize.gptq", "inputs": {"model": "yarn"}, "params": quant},
        {"stage": "quantize.awq", "inputs": {"model": "yarn"}, "params": {**quant, "format": "gptq", "n_grid": 2}},
        {
            "stage": "serve.validate",
            "inputs": {"model": "gptq", "draft": "draft"},
            "params": {"num_prompts": 2, "prompt_tokens": 8, "max_tokens": 6, "batch_sizes": [1]},
        },
    ]


def run_stages(root: Path, tiny: Path, names: tuple[str, ...]) -> Path:
    """Run the named stages of :func:`stages` (in order) through the pipeline; the run directory."""
    from warsha import pipeline
    from warsha.config import parse_recipe

    data = tiny_recipe("chat")
    every = stages(instruct_source(tiny, root / "instruct-src"))
    data["stages"] = [s for s in every if s["stage"] in names]
    recipe = parse_recipe(data)
    pipeline.Runner(recipe, root / "run").run(pipeline.plan(recipe, root / "run"), set(range(len(data["stages"]))))
    return root / "run"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_artifact: Path) -> Path:
    """Every stage: the slow end-to-end run."""
    names = tuple(s["stage"] for s in stages(Path()) if s["stage"] != "quantize.rtn")  # rtn: the fast test's
    return run_stages(tmp_path_factory.mktemp("chat-run"), tiny_artifact, names)


def check_artifacts(run: Path, names: tuple[str, ...]) -> None:
    """Each artifact's template and stop ids are the import's, in its files and its manifest."""
    from transformers import AutoTokenizer

    from warsha.artifacts import read_manifest

    expected = tokenizer_files.chat_setup(run / "import")
    assert expected["chat_template"] and expected["stop_ids"] == STOP_IDS
    assert tokenizer_files.chat_template(run / "import") == TEMPLATE
    for name in names:
        assert tokenizer_files.chat_setup(run / name) == expected, name
        assert read_manifest(run / name)["chat"] == expected, name
        assert AutoTokenizer.from_pretrained(run / name).chat_template == TEMPLATE, name


def ask(served: Path) -> None:
    """serve's /v1/chat/completions answers with the prompt the template builds."""
    from transformers import AutoTokenizer

    from tests.serve.test_api import running_server

    messages = [{"role": "user", "content": "قال رسول الله"}]
    tok = AutoTokenizer.from_pretrained(served)
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    with running_server(served, name="chat", num_kv_blocks=16) as srv:
        r = srv.client().chat.completions.create(model="chat", messages=messages, max_completion_tokens=5)
    assert r.usage.prompt_tokens == len(prompt)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1


def test_extend_embed_and_quantize_keep_the_chat_setup(tmp_path: Path, tiny_artifact: Path) -> None:
    """The fast part in the default suite: the three ways a stage carries the files (a new
    tokenizer beside copied model files, new weights beside a copied tokenizer, an exported
    checkpoint), then chat over HTTP on the quantized model."""
    run = run_stages(tmp_path, tiny_artifact, ("import", "tokenizer_ext.extend", "tokenizer_ext.embed", "quantize.rtn"))
    check_artifacts(run, ("extend", "embed", "rtn"))
    ask(run / "rtn")


MODEL_ARTIFACTS = ("import", "extend", "embed", "adapt", "yarn", "draft", "gptq", "awq")


@pytest.mark.slow
def test_every_artifact_keeps_the_template_and_stop_ids(run_dir: Path) -> None:
    check_artifacts(run_dir, MODEL_ARTIFACTS)
    # yarn's own generation settings stay (its longer max_length) beside the carried stop ids
    assert json.loads((run_dir / "yarn" / "generation_config.json").read_text())["max_length"] == 128


@pytest.mark.slow
def test_adapt_scores_the_chat_answers_of_all_three_models(run_dir: Path) -> None:
    from warsha.artifacts import read_manifest

    m = read_manifest(run_dir / "adapt")["metrics"]
    for name in ("base_model", "base_same_budget", "extended"):
        chat = m[name]["chat"]
        assert set(chat["answers"]) == {"ar", "en"}
        for lang in ("ar", "en"):
            assert len(chat["answers"][lang]) == 4 and 0.0 <= chat[lang]["turn_ended"] <= 1.0
            for answer in chat["answers"][lang]:
                assert answer["tokens"] <= 6
                assert answer["turn_ended"] == ("</s>" in answer["special_tokens"] and answer["tokens"] <= 6)
    assert set(m["chat_targets"]) == {"extended", "base_same_budget"}
    assert "same_special_tokens" in m["chat_targets"]["extended"]


@pytest.mark.slow
def test_serve_answers_chat_on_the_validated_artifact(run_dir: Path) -> None:
    from warsha.artifacts import read_manifest

    validated = read_manifest(run_dir / "validate")["metrics"]
    assert validated["outputs_match"] is True
    assert validated["chat"]["finish_reason"] in ("stop", "length") and validated["chat"]["prompt_tokens"] > 4
    ask(run_dir / "gptq")  # serve.validate's model input
