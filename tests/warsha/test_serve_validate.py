"""serve.validate drives the bundled engine with a target and a draft from disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import tiny_recipe
from warsha import artifacts, pipeline
from warsha.config import parse_recipe


def test_validate_stage_with_self_draft(tiny_artifact: Path, tmp_path: Path) -> None:
    data = tiny_recipe()
    data["base"] = str(tiny_artifact)
    data["stages"] = [
        {
            "stage": "serve.validate",
            "inputs": {"draft": str(tiny_artifact)},
            "params": {
                "num_prompts": 3,
                "prompt_tokens": 8,
                "max_tokens": 12,
                "engine": {
                    "num_speculative_tokens": 3,
                    "adaptive_speculation": False,  # every step drafts the full window of 3
                },
                "batch_sizes": [1, 3],
            },
        }
    ]
    recipe = parse_recipe(data)
    pipeline.Runner(recipe, tmp_path).run(pipeline.plan(recipe, tmp_path), {0})
    m = artifacts.read_manifest(tmp_path / "validate")["metrics"]
    assert m["outputs_match"] is True
    assert m["int4_activations"] == "float"  # the exact check's default (int8 rows round float noise)
    assert m["adaptive_speculation"] is False
    for bs in (1, 3):
        spec = m[f"batch{bs}"]["speculative"]
        # The draft is the target itself: every greedy proposal must be accepted.
        assert spec["acceptance_rate"] == pytest.approx(1.0)
        assert spec["mean_accepted_length"] == pytest.approx(4.0, abs=0.5)
        assert m[f"batch{bs}"]["plain"]["ttft_p50"] > 0 and spec["tpot_p50"] > 0
    assert (tmp_path / "validate" / "serve_validate.md").is_file()


def test_validate_with_prompt_lookup_measures_each_proposer_alone_too(tiny_artifact: Path, tmp_path: Path) -> None:
    data = tiny_recipe()
    data["base"] = str(tiny_artifact)
    params = {"num_prompts": 3, "prompt_tokens": 8, "max_tokens": 24, "batch_sizes": [1]}
    params["engine"] = {"prompt_lookup_max": 3}
    data["stages"] = [{"stage": "serve.validate", "inputs": {"draft": str(tiny_artifact)}, "params": params}]
    recipe = parse_recipe(data)
    pipeline.Runner(recipe, tmp_path).run(pipeline.plan(recipe, tmp_path), {0})
    m = artifacts.read_manifest(tmp_path / "validate")["metrics"]
    assert m["outputs_match"] is True and m["prompt_lookup_max"] == 3
    both, alone = m["batch1"]["speculative"], m["batch1"]["draft_alone"]
    assert alone["lookup_share"] == 0 and alone["draft_acceptance_rate"] == pytest.approx(1.0)
    if both["lookup_share"]:  # the self-draft accepts all it drafts; lookups may miss
        assert both["draft_acceptance_rate"] in (None, pytest.approx(1.0))
    assert alone["speedup"] > 0 and not alone["mismatched_requests"]
    lookup = m["batch1"]["lookup_alone"]  # prompt lookup without the draft model: every draft a lookup
    assert lookup["lookup_share"] in (None, pytest.approx(1.0)) and not lookup["mismatched_requests"]
    assert lookup["draft_acceptance_rate"] is None and lookup["speedup"] > 0
    summary = (tmp_path / "validate" / "serve_validate.md").read_text()
    assert "1, draft alone" in summary and "1, lookup alone" in summary


def test_validate_answers_a_chat_prompt_where_the_target_has_a_template(tiny_artifact: Path, tmp_path: Path) -> None:
    """A target with a chat template gets one templated question answered with the stage's engine
    options (the check once read options that had moved into the ``engine`` block, and failed)."""
    import shutil

    model = tmp_path / "instruct"
    shutil.copytree(tiny_artifact, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}"
    )
    data = tiny_recipe()
    data["base"] = str(model)
    params = {"num_prompts": 2, "prompt_tokens": 8, "max_tokens": 4, "batch_sizes": [1]}  # the tiny model: 64 positions
    data["stages"] = [{"stage": "serve.validate", "inputs": {"draft": str(model)}, "params": params}]
    recipe = parse_recipe(data)
    pipeline.Runner(recipe, tmp_path / "run").run(pipeline.plan(recipe, tmp_path / "run"), {0})
    chat = artifacts.read_manifest(tmp_path / "run" / "validate")["metrics"]["chat"]
    assert chat["prompt_tokens"] > 0 and 0 < chat["completion_tokens"] <= 4
    assert chat["finish_reason"] in ("stop", "length")


def test_validate_requires_a_draft_input() -> None:
    from warsha.config import RecipeError

    data = tiny_recipe()
    data["stages"].append({"stage": "serve.validate"})
    with pytest.raises(RecipeError, match=r"stages\[1\].inputs.draft: required"):
        parse_recipe(data)


def test_first_difference() -> None:
    from warsha.serve_validate import first_difference

    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


class _FakeOut:
    def __init__(self, logprobs: dict[int, float]) -> None:
        self.logprobs = [logprobs]


class _FakeEngine:
    """Answers a one-token logprobs request the way serve's LLM does."""

    def __init__(self, logprobs: dict[int, float]) -> None:
        self.logprobs, self.calls = logprobs, []

    def generate(self, prompts: list[list[int]], params: object) -> list[_FakeOut]:
        self.calls.append((prompts, params))
        return [_FakeOut(self.logprobs)]


def test_top2_gap_names_only_flips_between_the_two_best_tokens() -> None:
    from warsha.serve_validate import top2_gap

    engine = _FakeEngine({7: -1.0000, 9: -1.0002, 4: -3.0})
    assert top2_gap(engine, [1, 2], {7, 9}) == pytest.approx(2e-4)
    prompts, params = engine.calls[0]
    assert prompts == [[1, 2]] and params.max_tokens == 1 and params.logprobs == 2
    assert top2_gap(engine, [1, 2], {7, 4}) == float("inf")  # the third-best token is no tie
    assert top2_gap(engine, [1, 2], {7}) == float("inf")  # one run ended early


def test_compare_outputs_separates_near_ties_from_real_mismatches() -> None:
    from warsha.serve_validate import compare_outputs

    prompts = [[1], [1], [1]]
    plain = [[5, 7, 8], [5, 6, 6], [5, 7, 3]]
    spec = [[5, 9, 8], [5, 6, 6], [5, 4, 3]]
    engine = _FakeEngine({7: -1.0, 9: -1.0002, 4: -2.5})  # 7 and 9 tie; 4 is far behind
    r = compare_outputs(engine, prompts, plain, spec, tolerance=1e-3)
    assert r["mismatched_requests"] == 2 and r["near_tie_flips"] == 1
    assert [d["request"] for d in r["divergences"]] == [0, 2]
    assert r["divergences"][0]["top2_gap"] == pytest.approx(2e-4) and r["divergences"][1]["top2_gap"] is None
    assert engine.calls[0][0] == [[1, 5]]  # the prefix up to the divergence
    assert compare_outputs(engine, prompts, plain, spec, tolerance=1e-5)["near_tie_flips"] == 0


def test_engine_block_reaches_every_engine_as_engine_args(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe's ``engine:`` options, over serve.validate's documented defaults, are the
    EngineArgs of the plain, speculative, draft-alone and lookup-alone engines (lookup in the
    speculative and the lookup-alone ones only)."""
    import dataclasses
    from types import SimpleNamespace

    import serve.engine
    from serve.args import EngineArgs
    from warsha import serve_validate as sv
    from warsha.schema import from_dict

    seen: list[tuple[object, EngineArgs]] = []
    monkeypatch.setattr(serve.engine, "LLM", lambda model, draft, args: seen.append((draft, args)) or args)
    stats = {"output_tokens_per_s": 1.0}
    monkeypatch.setattr(sv, "run_interleaved", lambda engines, *a: ([[]] * len(engines), [stats] * len(engines)))
    monkeypatch.setattr(sv, "compare_outputs", lambda *a: {})
    problems: list[str] = []
    engine = {"head_quant": "int8", "prompt_lookup_max": 3, "num_speculative_tokens": 2, "dtype": "bfloat16"}
    p = from_dict(sv.ValidateParams, {"engine": engine}, "params", problems)
    assert problems == []
    sv.measure_batch(SimpleNamespace(model_dir="m", inputs={"draft": "d"}), p, [[1]], 4)
    want = EngineArgs(
        dtype="bfloat16",
        int4_activations="float",
        kv_cache_memory_gb=0.5,
        head_quant="int8",
        prompt_lookup_max=3,
        num_speculative_tokens=2,
        max_num_seqs=4,
    )
    assert seen == [
        (None, dataclasses.replace(want, prompt_lookup_max=0)),
        ("d", want),
        ("d", dataclasses.replace(want, prompt_lookup_max=0)),
        (None, want),
    ]


def test_bad_engine_block_is_named_before_anything_runs() -> None:
    from warsha.config import RecipeError

    data = tiny_recipe()
    engine = {"kv_cache_gb": 1, "block_size": "x", "max_num_seqs": 2}
    data["stages"].append({"stage": "serve.validate", "inputs": {"draft": "bootstrap"}, "params": {"engine": engine}})
    with pytest.raises(RecipeError) as err:
        parse_recipe(data)
    text = str(err.value)
    assert "stages[1].params.engine.kv_cache_gb: not an engine option" in text
    assert "engine.block_size: expected int" in text and "engine.max_num_seqs: set by batch_sizes" in text
    data["stages"][-1]["params"] = {"engine": {"dtype": "fp8"}}
    with pytest.raises(RecipeError, match=r"params.engine: dtype='fp8' is not supported"):
        parse_recipe(data)
