"""The scoring forward (warsha.score_forward) against the model's whole logits in float64."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from warsha import score_forward as sf
from warsha.random_models import make_model


def _model(tmp_path: Path, arch: str, dtype: torch.dtype = torch.float64, **overrides: Any) -> Any:
    from transformers import AutoModelForCausalLM

    path = make_model(tmp_path / arch, arch=arch, dtype=dtype, **overrides)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _batch(model: Any, rows: int = 3, width: int = 20) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, their mask and targets with unscored context and padding (-100)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 14:] = 0  # a shorter row
    target = ids[:, 1:].clone()
    target[mask[:, 1:] == 0] = -100
    target[0, :9] = -100  # a sliding window's context: not scored
    return ids, mask, target


def _brute(model: Any, ids: torch.Tensor, mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the summed NLL from the model's own float64 log-softmax at every position."""
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.double(), dim=-1)
    picked = logp[:, :-1].gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(picked * (target != -100)).sum(dim=1)


@pytest.mark.parametrize(
    "arch,overrides,fused",
    [
        ("llama", {}, True),
        ("qwen3", {"tie_word_embeddings": True}, True),
        ("gemma3", {"final_logit_softcapping": 2.0}, False),  # a soft-cap: only its forward is right
    ],
)
def test_rows_nll_matches_the_whole_log_softmax(tmp_path: Path, arch: str, overrides: dict, fused: bool) -> None:
    """The head on scored positions only, in vocabulary slices that do not divide the vocabulary
    (a plain or tied head), or the model's whole logits (a soft-capped head), equal the whole
    float64 log-softmax to rounding; each model takes the path its head allows."""
    model = _model(tmp_path, arch, **overrides)
    ids, mask, target = _batch(model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sf, "VOCAB_SLICE", 37)
        mp.setattr(sf, "NLL_POSITIONS", 5)
        calls: list[str] = []
        for name in ("_scored_nll", "_whole_logits_nll"):
            mp.setattr(sf, name, _counted(getattr(sf, name), name, calls))
        with torch.no_grad():
            got = sf.rows_nll(model, ids, mask, target)
    assert calls == ["_scored_nll" if fused else "_whole_logits_nll"]
    torch.testing.assert_close(got, _brute(model, ids, mask, target), rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("gemma3", {"final_logit_softcapping": 2.0})])
def test_rows_probability_matches_the_whole_softmax(tmp_path: Path, arch: str, overrides: dict) -> None:
    """The mass on marked rows at each position, from vocabulary slices (a plain head) or the
    model's own logits (a soft-capped head), equals the float64 softmax summed over those rows;
    a slice with no marked row and a mask marking nothing give exactly 0."""
    model = _model(tmp_path, arch, **overrides)
    ids = _batch(model)[0][:1]
    rows = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    rows[torch.arange(5, 60, 3)] = True  # slices of 37: the third marks a few, the last none
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=ids).logits[0, :-1].double(), dim=-1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sf, "VOCAB_SLICE", 37)
        mp.setattr(sf, "NLL_POSITIONS", 7)
        with torch.no_grad():
            got = sf.rows_probability(model, ids, rows)
            none = sf.rows_probability(model, ids, torch.zeros_like(rows))
    torch.testing.assert_close(got, probs[:, rows].sum(-1), rtol=1e-12, atol=1e-14)
    assert got.shape == (ids.shape[1] - 1,) and torch.equal(none, torch.zeros_like(got))


def _counted(fn: Any, name: str, calls: list[str]) -> Any:
    def wrapped(*args: Any) -> Any:
        calls.append(name)
        return fn(*args)

    return wrapped


def test_bf16_autocast_only_for_a_float32_model_where_asked(tmp_path: Path) -> None:
    """bf16=True scores a float32 model under bf16 autocast (NLLs within 1%, not equal); a
    float64 model and bf16=False stay exact."""
    f32 = _model(tmp_path, "llama", dtype=torch.float32)
    ids, mask, target = _batch(f32)
    assert sf.scoring_dtype(f32, bf16=True) == "bfloat16"
    assert sf.scoring_dtype(f32, bf16=False) == "float32"
    with torch.no_grad():
        exact = sf.rows_nll(f32, ids, mask, target, bf16=False)
        low = sf.rows_nll(f32, ids, mask, target, bf16=True)
    torch.testing.assert_close(exact, _brute(f32, ids, mask, target), rtol=1e-5, atol=1e-4)
    assert not torch.equal(low, exact)
    torch.testing.assert_close(low, exact, rtol=1e-2, atol=0.0)
    f64 = _model(tmp_path / "64", "llama")
    assert sf.scoring_dtype(f64, bf16=True) == "float64"
