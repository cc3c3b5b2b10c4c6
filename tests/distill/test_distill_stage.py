"""The distill.draft stage end to end on the tiny target, its params schema and refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from distill.stages import STAGES, DraftParams
from warsha.schema import from_dict

TINY = {
    "layers": [0],
    "max_train_documents": 80,
    "eval_documents": 6,
    "eval_len": 48,
    "prompt_len": 8,
    "gen_len": 8,
    "spec_prompts": 2,
    "spec_prompt_len": 8,
    "spec_new_tokens": 8,
    "spec_ks": [1, 2],
    "train": {"steps": 6, "batch_size": 4, "seq_len": 48, "lr": 2e-3, "warmup_steps": 1, "checkpoint_every": 3},
}


def _params(**over: Any) -> DraftParams:
    problems: list[str] = []
    p = from_dict(DraftParams, {**TINY, **over}, "params", problems)
    assert not problems, problems
    return p


def test_stage_writes_a_loadable_draft_and_reports(tmp_path: Path, ctx_factory: Any, target_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distill.draft import first_vocab_difference

    ctx = ctx_factory(tmp_path)
    metrics = STAGES["draft"].run(ctx, _params(draft_vocab_size=50))
    model = AutoModelForCausalLM.from_pretrained(ctx.out_dir)
    vocab_file = json.loads((ctx.out_dir / "draft_vocab.json").read_text())
    assert len(vocab_file["token_ids"]) == 50 == metrics["draft_vocab"]["size"]
    assert 0.0 < metrics["draft_vocab"]["held_out_coverage"] < 1.0
    assert model.config.num_hidden_layers == 1
    assert model.config.rope_parameters["rope_type"] == "yarn"
    tok = AutoTokenizer.from_pretrained(ctx.out_dir)
    assert first_vocab_difference(AutoTokenizer.from_pretrained(target_dir), tok) is None
    for f in ("acceptance.json", "acceptance.md", "acceptance_vs_k.png"):
        assert (ctx.out_dir / f).is_file()
    assert set(metrics["acceptance"]) == {"init", "distilled", "baseline"}
    for acc in metrics["acceptance"].values():
        assert 0.0 <= acc["t0"] <= 1.0 and 0.0 <= acc["t1"] <= 1.0
    assert set(metrics["gain_over_baseline"]) == {"t0", "t1"}
    per = metrics["acceptance_by_language"]["distilled"]
    assert len(per) == 2 and all(0.0 <= r["t0"] <= 1.0 for r in per.values())
    assert sum(r["positions"] for r in per.values()) == metrics["acceptance"]["distilled"]["positions"]
    assert "By language" in (ctx.out_dir / "acceptance.md").read_text()
    run = metrics["speculative"]["distilled"]["t1"]["2"]
    assert run["accepted"] <= run["proposed"] and run["mean_accepted_length"] >= 1.0
    sp = metrics["speedup"]["distilled"]["t1"]
    assert sp["best_k"] in (1, 2) and 0.0 <= sp["alpha"] <= 1.0 and 0.0 <= sp["analytic_on_visited"] <= 1.0
    assert "per-token acceptance over all k" in (ctx.out_dir / "acceptance.md").read_text().lower()
    assert metrics["cost"]["cost_ratio"] > 0
    assert metrics["draft"]["parameters"] < metrics["draft"]["target_parameters"]
    json.dumps(metrics)  # the manifest must be able to hold it
    # a rerun of the same job (same checkpoint dir) reloads both trainings instead of redoing them
    again = STAGES["draft"].run(ctx_factory_reuse(ctx, tmp_path / "again"), _params(spec_ks=[1]))
    assert again["train"]["distill"] == metrics["train"]["distill"]
    assert again["acceptance"]["distilled"] == metrics["acceptance"]["distilled"]


def test_pooled_acceptance_equals_one_pass_over_every_sequence(target_dir: Path) -> None:
    """Per-language results pooled by positions must equal acceptance measured in one call."""
    import torch
    from transformers import AutoModelForCausalLM

    from distill.draft import layer_subset
    from distill.report import pooled
    from warsha.speculative import analytic_acceptance

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = layer_subset(target, [0]).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 100, (int(n),), generator=g).tolist() for n in torch.randint(5, 30, (7,), generator=g)]
    groups = {"ar": seqs[:3], "en": seqs[3:]}
    per = {k: analytic_acceptance(target, draft, v, (0.0, 1.0), 32) for k, v in groups.items()}
    whole = analytic_acceptance(target, draft, seqs, (0.0, 1.0), 32)
    got = pooled(per)
    assert got["positions"] == whole["positions"]
    assert got["t0"] == pytest.approx(whole["t0"], abs=1e-6) and got["t1"] == pytest.approx(whole["t1"], abs=1e-6)


@pytest.mark.parametrize("on_policy", [0.0, 1.0])
def test_stage_distils_over_the_draft_vocabulary(
    tmp_path: Path, ctx_factory: Any, target_dir: Path, on_policy: float
) -> None:
    """distill_vocab 'draft': the layers learn, the embedding and head stay the target's, the
    saved draft has its full head back, and acceptance is measured over the served ids; with
    on-policy steps the target continues prompts among the served ids."""
    import torch
    from transformers import AutoModelForCausalLM

    ctx = ctx_factory(tmp_path)
    p = _params(
        distill_vocab="draft",
        draft_vocab_size=50,
        on_policy_fraction=on_policy,
        on_policy_source="target",
        gen_temperature=0.0,
        baseline=False,
        spec_ks=[1],
    )
    metrics = STAGES["draft"].run(ctx, p)
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    draft = AutoModelForCausalLM.from_pretrained(ctx.out_dir)
    emb = target.get_input_embeddings().weight
    assert torch.equal(draft.get_input_embeddings().weight, emb)
    assert torch.equal(draft.get_output_embeddings().weight, target.get_output_embeddings().weight)
    assert not torch.equal(draft.model.layers[0].mlp.down_proj.weight, target.model.layers[0].mlp.down_proj.weight)
    assert metrics["acceptance_over"] == "50 served ids"
    assert metrics["train"]["distill"]["steps_run"] == 6
    assert 0.0 <= metrics["acceptance"]["distilled"]["t0"] <= 1.0


def ctx_factory_reuse(ctx: Any, out: Path) -> Any:
    """The same job's context with a fresh output directory (as after a killed run)."""
    import dataclasses

    out.mkdir(parents=True)
    return dataclasses.replace(ctx, out_dir=out)


def test_missing_layers_refused_before_any_work(tmp_path: Path, ctx_factory: Any) -> None:
    ctx = ctx_factory(tmp_path)
    with pytest.raises(ValueError, match=r"layers: \[9\] do not exist"):
        STAGES["draft"].run(ctx, _params(layers=[0, 9]))
    assert not any(ctx.out_dir.iterdir()) and not ctx.checkpoint_dir.exists()


def test_foreign_draft_refused_before_any_work(tmp_path: Path, ctx_factory: Any, target_dir: Path, target: Any) -> None:
    import shutil

    from distill.draft import layer_subset

    other = tmp_path / "other"
    layer_subset(target, [0]).save_pretrained(other)
    for f in target_dir.iterdir():
        if f.name.startswith(("tokenizer", "special")):
            shutil.copy2(f, other / f.name)
    tj = json.loads((other / "tokenizer.json").read_text())
    inv = {i: s for s, i in tj["model"]["vocab"].items()}
    tj["model"]["vocab"][inv[200]], tj["model"]["vocab"][inv[300]] = 300, 200
    (other / "tokenizer.json").write_text(json.dumps(tj))
    ctx = ctx_factory(tmp_path / "run")
    with pytest.raises(ValueError, match="at id 200"):
        STAGES["draft"].run(ctx, _params(method="model", draft_path=str(other)))
    assert not ctx.checkpoint_dir.exists()


def test_larger_draft_warns_in_the_stage(tmp_path: Path, ctx_factory: Any) -> None:
    from transformers import AutoModelForCausalLM

    from distill.run import build_draft

    ctx = ctx_factory(tmp_path)
    target = AutoModelForCausalLM.from_pretrained(ctx.model_dir)
    p = _params(method="config", hidden_size=128, intermediate_size=256, num_layers=6, init="random")
    with pytest.warns(UserWarning, match="not fewer"):
        build_draft(p, target, ctx)
    with pytest.raises(ValueError, match="hidden_size: 128 is wider"):
        STAGES["draft"].run(ctx, _params(method="config", hidden_size=128))


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"method": "config", "hidden_size": 100, "num_heads": 8}, "num_heads: must divide hidden_size 100"),
        ({"method": "model"}, "draft_path: method 'model' needs"),
        ({"method": "model", "draft_path": "/nonexistent"}, "no config.json"),
        ({"spec_ks": [0, 2]}, "spec_ks"),
        ({"loss": "kl"}, "params.loss: must be one of"),
        ({"on_policy_fraction": 1.5}, "on_policy_fraction: must be <= 1.0"),
        ({"temperature": 0.0}, "temperature: must be > 0.0"),
        ({"distill_vocab": "draft", "on_policy_fraction": 0.0}, "distill_vocab: 'draft' needs draft_vocab_size"),
        (
            {"distill_vocab": "draft", "draft_vocab_size": 50, "on_policy_fraction": 0.0, "teacher_cache_topk": 8},
            "teacher_cache_topk: the top-k cache",
        ),
    ],
)
def test_bad_params_are_reported_by_path(over: dict[str, Any], needle: str) -> None:
    problems: list[str] = []
    from_dict(DraftParams, {**TINY, **over}, "params", problems)
    assert any(needle in p for p in problems), problems


def test_stages_module_imports_without_torch() -> None:
    code = "import sys, distill.stages; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.stdout.strip() == "False False"


def test_only_decoding_runs_at_decode_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Teacher-forced scoring keeps every thread; the batch-1 decoding runs at ``decode_threads``;
    the setting comes back afterwards, also when the decoding fails."""
    import torch

    from distill import report

    seen: dict[str, int] = {}
    monkeypatch.setattr(report, "_teacher_forced", lambda *a: seen.update(scored=torch.get_num_threads()) or {})

    def decoding(*a: Any) -> None:
        seen["decoded"] = torch.get_num_threads()
        raise RuntimeError("decode failed")

    monkeypatch.setattr(report, "_decoding", decoding)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="decode failed"):
            report.measure(None, _params(decode_threads=1), None, {}, None, {})  # type: ignore[arg-type]
        assert seen == {"scored": 2, "decoded": 1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
