"""Units behind issue 20: stop strings on the tail, sha256 prefix keys, the manifest check,
SamplingParams' own validation and the engine's per-request failure isolation."""

from __future__ import annotations

import hashlib
import json
import math
import random
import struct
from pathlib import Path

import pytest

from serve import LLM, SamplingParams
from serve.block_manager import BlockManager, chain_hash
from serve.detokenizer import StopMatcher
from serve.manifest import ManifestError, verify_dir
from serve.sequence import Sequence
from tests.serve.conftest import CORPUS


def test_stop_matcher_finds_the_first_stop_like_a_full_decode(tiny_dir: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    decode = tok.decode  # the engine's tokenizer decodes the same way (skip_special_tokens)
    longest = 0

    def tracked(ids: list[int]) -> str:
        nonlocal longest
        longest = max(longest, len(ids))
        return decode(ids)

    rng = random.Random(0)
    words = " ".join(CORPUS).split()
    for trial in range(60):
        ids = tok.encode(" ".join(rng.choice(words) for _ in range(40)), add_special_tokens=False).ids
        full = decode(ids)
        stops = [full[p : p + rng.randint(1, 6)] for p in rng.sample(range(len(full) - 6), 2)] + ["zzqq"]
        include = trial % 2 == 0
        matcher = StopMatcher(tracked, stops, include)
        got, steps = None, 0
        for token in ids:
            steps += 1
            got = matcher.add(token)
            if got is not None:
                break
        expected, expected_steps = None, 0  # brute force: decode every prefix in full
        for m in range(1, len(ids) + 1):
            text = decode(ids[:m])
            hits = [(text.find(s), s) for s in stops if s in text]
            if hits:
                pos, s = min(hits)
                expected, expected_steps = ((text[: pos + len(s)] if include else text[:pos]), s), m
                break
        assert (got, steps) == (expected, expected_steps)
    assert longest <= 8  # never re-decodes the whole output


def test_prefix_keys_are_sha256_chained_over_block_ids() -> None:
    def reference(parent: bytes | None, ids: tuple[int, ...]) -> bytes:
        data = (parent if parent is not None else b"warsha-prefix-root") + b"".join(struct.pack("<q", i) for i in ids)
        return hashlib.sha256(data).digest()

    first = chain_hash(None, (1, 2, 3, 4))
    assert first == reference(None, (1, 2, 3, 4)) and len(first) == 32
    assert chain_hash(first, (5, 6, 7, 8)) == reference(first, (5, 6, 7, 8))
    assert chain_hash(first, (5, 6, 7, 8)) != chain_hash(None, (5, 6, 7, 8))
    bm = BlockManager(8, block_size=4)
    a = Sequence("a", list(range(1, 10)), 4, 0.0)
    assert bm.allocate_slots(a, a.num_tokens)
    bm.cache_full_blocks(a, 9)
    assert a.block_hashes == [first, chain_hash(first, (5, 6, 7, 8))]
    b = Sequence("b", list(range(1, 10)), 4, 0.0)
    assert bm.find_cached_prefix(b) == a.block_table[:2]


def _write_artifact(root: Path, files: dict[str, bytes], listed: dict[str, str] | None = None) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (root / name).write_bytes(data)
    hashes = listed if listed is not None else {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}
    (root / "warsha.json").write_text(json.dumps({"files": hashes, "digest": "x"}))


def test_manifest_check(tmp_path: Path) -> None:
    files = {"config.json": b"{}", "model.safetensors": b"weights"}
    _write_artifact(tmp_path / "ok", files)
    assert verify_dir(tmp_path / "ok") == 2
    assert verify_dir(tmp_path) == 0  # no manifest: nothing to check
    _write_artifact(tmp_path / "edited", files)
    (tmp_path / "edited" / "model.safetensors").write_bytes(b"weightz")
    with pytest.raises(ManifestError, match="model.safetensors: sha256 does not match"):
        verify_dir(tmp_path / "edited")
    _write_artifact(tmp_path / "extra", files)
    (tmp_path / "extra" / "model-00002.safetensors").write_bytes(b"smuggled")
    with pytest.raises(ManifestError, match="model-00002.safetensors: not listed"):
        verify_dir(tmp_path / "extra")
    _write_artifact(tmp_path / "missing", files, {"config.json": "0" * 64, "gone.safetensors": "0" * 64})
    with pytest.raises(ManifestError, match="sha256 does not match|missing"):
        verify_dir(tmp_path / "missing")
    _write_artifact(tmp_path / "escape", files, {"../x": "0" * 64})
    with pytest.raises(ManifestError, match="outside"):
        verify_dir(tmp_path / "escape")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "warsha.json").write_text("[1, 2")
    with pytest.raises(ManifestError, match="not readable JSON"):
        verify_dir(tmp_path / "bad")
    (tmp_path / "bad" / "warsha.json").write_text("[1, 2]")
    with pytest.raises(ManifestError, match="expected an object"):
        verify_dir(tmp_path / "bad")


def test_serve_refuses_a_directory_that_does_not_match_its_manifest(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import shutil

    import uvicorn

    from serve.api.cli import main

    model = tmp_path / "served"
    shutil.copytree(tiny_dir, model)
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in model.iterdir() if p.is_file()}
    (model / "warsha.json").write_text(json.dumps({"files": files}))
    ran: list[object] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: ran.append(app))
    assert main([str(model), "--dtype", "float32"]) == 0 and len(ran) == 1
    (model / "config.json").write_text((model / "config.json").read_text() + " ")
    assert main([str(model), "--dtype", "float32"]) == 2
    assert "config.json: sha256 does not match warsha.json" in capsys.readouterr().err
    assert main([str(model), "--dtype", "float32", "--no-verify"]) == 0 and len(ran) == 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -1}, "seed"),
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"stop": [3]}, "stop"),
    ],
)
def test_sampling_params_refuse_what_would_poison_a_batch(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)


def test_engine_refuses_before_holding_the_request(tiny_dir: Path) -> None:
    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="top_k"):
        llm.add_request("hi", SamplingParams(top_k=llm.config.vocab_size + 1))
    assert not llm.has_unfinished_requests()


def test_engine_fails_only_the_request_that_fails_alone(tiny_dir: Path) -> None:
    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=32)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["the quick", "paged attention"], greedy)
    real = llm.sampler

    def poisoned(logits, params, *rest):  # noqa: ANN001, ANN202
        if any(p.seed == 7 for p in params):
            raise RuntimeError("injected")
        return real(logits, params, *rest)

    llm.sampler = poisoned  # type: ignore[assignment]
    a = llm.add_request("the quick", greedy)
    bad = llm.add_request("hello", SamplingParams(seed=7, max_tokens=4))
    b = llm.add_request("paged attention", greedy)
    done = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out
    assert done[bad].finish_reason == "error" and "injected" in (done[bad].error or "")
    assert done[a].token_ids == alone[0].token_ids and done[b].token_ids == alone[1].token_ids
    llm.block_manager.check_no_leaks()
