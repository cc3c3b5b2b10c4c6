"""Server pieces without a server: incremental text, chat templates, Prometheus text, the CLI."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from serve.api.chat_template import ChatTemplate, ChatTemplateError, find_template
from serve.api.metrics import TTFT_BUCKETS, Histogram, MetricsSnapshot, render
from serve.detokenizer import IncrementalText
from tests.serve.conftest import CORPUS, make_model, write_tokenizer
from tests.serve.test_api import CHAT_TEMPLATE, add_chat_template, hf_chat_ids, parse_prometheus

TEXTS = ["مرحبا بالعالم هذا نص عربي قصير", "the quick brown fox jumps over the lazy dog", "ٱلسَّلَامُ عَلَيْكُمْ 🌙 café"]


def metaspace_tokenizer(path: Path) -> Path:
    """A SentencePiece-style tokenizer (Metaspace strips the leading space when decoding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Metaspace()])
    alphabet = [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"] + alphabet)
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_incremental_text_equals_full_decode(tmp_path: Path, kind: str) -> None:
    from tokenizers import Tokenizer

    if kind == "byte_level":
        write_tokenizer(tmp_path)
        path = tmp_path / "tokenizer.json"
    else:
        path = metaspace_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(path))
    rng = random.Random(0)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        full = tok.decode(ids)
        for holdback in (0, 4):
            inc, sent, pos = IncrementalText(tok.decode, holdback), "", 0
            while pos < len(ids):
                step = rng.randint(1, 3)  # speculative steps append several tokens at once
                inc.add(ids[pos : pos + step])
                pos += step
                piece = inc.next_delta(None)
                assert "\ufffd" not in piece
                sent += piece
                assert full.startswith(sent) and len(sent) <= max(0, len(inc.text) - holdback)
            sent += inc.next_delta(full)
            assert sent == full


def test_chat_template_sources_and_errors(tmp_path: Path) -> None:
    model = add_chat_template(make_model(tmp_path / "m"))
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "مرحبا"},
    ]
    assert ChatTemplate(model).encode(messages) == hf_chat_ids(model, messages)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHAT_TEMPLATE}]
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert find_template(model) == CHAT_TEMPLATE
    strict = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    (model / "chat_template.jinja").write_text(strict)  # transformers 5 keeps it here; it wins
    assert find_template(model) == strict
    with pytest.raises(ChatTemplateError, match="no system role"):
        ChatTemplate(model).encode([{"role": "system", "content": "x"}])
    bare = tmp_path / "bare"
    write_tokenizer(bare)
    assert not ChatTemplate(bare).available
    with pytest.raises(ChatTemplateError, match="/v1/completions"):
        ChatTemplate(bare).encode(messages)


def test_histogram_buckets_are_inclusive_and_cumulative() -> None:
    h = Histogram(TTFT_BUCKETS)
    for v in (0.001, 0.0011, 0.5, 1000.0):
        h.observe(v)
    m = parse_prometheus(render(MetricsSnapshot("m", ttft=h, finished={"stop": 3})))
    assert m["warsha_time_to_first_token_seconds_bucket{le=0.001}"] == 1  # le is inclusive
    assert m["warsha_time_to_first_token_seconds_bucket{le=0.005}"] == 2
    assert m["warsha_time_to_first_token_seconds_bucket{le=0.5}"] == 3
    assert m["warsha_time_to_first_token_seconds_bucket{le=80}"] == 3
    assert m["warsha_time_to_first_token_seconds_bucket{le=+Inf}"] == 4 == m["warsha_time_to_first_token_seconds_count"]
    assert m["warsha_time_to_first_token_seconds_sum"] == pytest.approx(1000.5021)
    assert m["warsha_request_success_total{finished_reason=stop}"] == 3
    assert m["warsha_request_success_total{finished_reason=abort}"] == 0


def test_cli_help_and_warsha_delegation(capsys: pytest.CaptureFixture[str]) -> None:
    from serve.api.cli import build_parser
    from warsha.cli import main as warsha_main

    parser = build_parser()
    for action in parser._actions:
        assert action.help, f"{action.dest} has no help text"
    with pytest.raises(SystemExit) as info:
        warsha_main(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: warsha serve") and "--kv-cache-memory-gb" in out and "--served-model-name" in out
    assert warsha_main(["serve", "/nonexistent/model"]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.slow
def test_python_m_serve_end_to_end(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "serve",
            str(model),
            "--port",
            str(port),
            "--served-model-name",
            "t",
            "--dtype",
            "float32",
            "--threads",
            "1",
            "--log-level",
            "warning",
        ],
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "t", "prompt": "hello", "max_tokens": 5, "ignore_eos": True},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    finally:
        proc.terminate()
        proc.wait(timeout=30)
