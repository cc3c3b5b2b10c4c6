"""``context_ext.retrieval_rows`` (``python -m benchmarks.retrieval_standin``): its rows teach copying
without leaking the evaluation."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from context_ext import passkey
from context_ext import retrieval_rows as mod

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok(tiny_artifact: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_artifact)


def test_digit_ids_are_the_ten_digits(tok: Any) -> None:
    ids = mod.digit_ids(tok)
    assert [tok.decode([i]).strip() for i in ids] == list("0123456789")


def test_digit_row_weights_mark_exactly_the_predictable_copies() -> None:
    digits = list(range(100, 110))
    for seed in range(50):
        ids, w = mod.digit_row(digits, 96, random.Random(seed), bos=1)
        assert len(ids) == len(w) == 96 and ids[0] == 1
        body = ids[1:]
        span = next(p for p in range(6, 25) if body[p:] == body[: len(body) - p])
        # brute force: a weighted target equals the token one span earlier, and follows a
        # token that also repeats (so an induction step predicts it); nothing else is weighted
        for j in range(1, 96):
            copy = j - 1 >= span and (j - 1) % span != 0
            assert w[j] == (1.0 if copy else 0.0), (seed, j)
            if copy:
                assert ids[j] == ids[j - span]


def test_passkey_rows_use_training_keys_and_depths_only(tiny_artifact: Path, tok: Any) -> None:
    fmt = passkey.PasskeyFormat(tok)
    filler = list(range(2000, 2400))
    for seed in range(40):
        ids, w = mod.passkey_row(fmt, filler, 64, random.Random(seed))
        key = tok.decode(ids[-6:]).strip()
        assert passkey.key_split(int(key)) == "train"
        assert w[-6:] == [1.0] * 6
        # the needle's second mention: its digits after the first are weighted, nothing else
        assert 4 <= sum(w[:-6]) <= 4
        marked = [j for j, x in enumerate(w[:-6]) if x]
        assert [ids[j] for j in marked] == ids[-4:]


def test_row_mix_is_reproducible_and_mixes(tok: Any) -> None:
    fmt = passkey.PasskeyFormat(tok)
    mix = mod.RowMix(
        fmt, list(range(2000, 2400)), list(range(3000, 3400)), mod.digit_ids(tok), [64, 128], 1024, 0.3, 0.2, seed=1
    )
    a, b = mix(7), mix(7)
    assert (a["input_ids"] == b["input_ids"]).all() and (a["loss_weights"] == b["loss_weights"]).all()
    kinds = {"digit": 0, "corpus": 0, "passkey": 0}
    digits = set(mod.digit_ids(tok))
    for step in range(30):
        batch = mix(step)
        assert batch["input_ids"].shape[0] * batch["input_ids"].shape[1] == 1024
        for row in batch["input_ids"].tolist():
            if set(row[1:]) <= digits:
                kinds["digit"] += 1
            elif all(3000 <= t < 3400 for t in row[1:]):
                kinds["corpus"] += 1
            else:
                kinds["passkey"] += 1
    total = sum(kinds.values())
    assert 0.2 < kinds["digit"] / total < 0.4 and 0.1 < kinds["corpus"] / total < 0.3


def test_bad_lengths_name_the_flag() -> None:
    with pytest.raises(SystemExit, match="--lengths"):
        mod.row_lengths("64,512", 256)


def test_writes_a_loadable_standin_with_its_curve(tiny_artifact: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "standin"
    argv = [
        "--model",
        str(tiny_artifact),
        "--out",
        str(out),
        "--steps",
        "2",
        "--eval-every",
        "1",
        "--trials",
        "5",
        "--lengths",
        "64",
        "--tokens",
        "128",
        "--collections",
        "bukhari",
        "--threads",
        "1",
    ]
    subprocess.run([sys.executable, "-m", "benchmarks.retrieval_standin", *argv], check=True, cwd=ROOT)
    report = json.loads((out / "retrieval_standin.json").read_text())
    assert [c["step"] for c in report["curve"]] == [1, 2]
    assert all(0.0 <= c["passkey_at_context"] <= 1.0 for c in report["curve"])
    assert AutoModelForCausalLM.from_pretrained(out).config.max_position_embeddings == 64
    assert not (tmp_path / "standin.tmp").exists()


def test_rate_warms_up_then_holds_or_decays_to_a_tenth() -> None:
    rate = mod.rate
    for schedule in ("constant", "cosine"):
        assert [rate(1e-3, s, 100, schedule) for s in range(10)] == pytest.approx([1e-4 * (s + 1) for s in range(10)])
    assert {rate(1e-3, s, 100, "constant") for s in range(10, 100)} == {1e-3}
    cosine = [rate(1e-3, s, 100, "cosine") for s in range(10, 101)]
    assert cosine[0] == pytest.approx(1e-3) and cosine[-1] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(cosine, cosine[1:]))
