"""Property-based fuzzing of /v1/completions and /v1/chat/completions against a live server.

Hypothesis generates bodies whose known fields hold anything JSON can (wrong types, huge,
negative, NaN and infinite numbers, lone surrogates, nested junk) next to plausible values.
Properties: every answer is 2xx or 4xx with an OpenAI error body, never 5xx (streamed answers
carry no server_error event); meanwhile a well-formed greedy request, repeated in a background
thread, always completes with exactly the tokens it produces alone; afterwards no KV block leaks.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve.conftest import make_model
from tests.serve.test_api import RunningServer, add_chat_template, running_server

WELL_FORMED = {"model": "tiny", "prompt": "the quick brown", "max_tokens": 12, "temperature": 0, "ignore_eos": True}

SURROGATES = st.sampled_from(["\ud800", "\udfff", "a\ud83db"])
STRINGS = st.one_of(st.text(max_size=12), SURROGATES, st.sampled_from(["", "tiny", "\x00", "x" * 300, "🙂", "ذا"]))
NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 1e-40, 2**63, 2**64, 1e308, -0.0]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, STRINGS)
ANY = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(STRINGS, inner, max_size=3), max_leaves=8
)
COMMON = {
    "model": ANY,
    "max_tokens": st.one_of(st.integers(min_value=-2, max_value=20), ANY),
    "temperature": st.one_of(st.floats(min_value=0, max_value=2), ANY),
    "top_p": st.one_of(st.floats(min_value=0, max_value=1), ANY),
    "top_k": st.one_of(st.integers(min_value=-2, max_value=400), ANY),
    "n": ANY,
    "stream": st.one_of(st.booleans(), ANY),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), ANY),
    "stop": st.one_of(st.lists(STRINGS, max_size=20), ANY),
    "seed": st.one_of(st.integers(min_value=-1, max_value=2**64), ANY),
    "presence_penalty": ANY,
    "frequency_penalty": ANY,
    "repetition_penalty": st.one_of(st.floats(min_value=0.5, max_value=2), ANY),
    "logit_bias": ANY,
    "ignore_eos": st.one_of(st.booleans(), ANY),
    "stop_token_ids": st.one_of(st.lists(st.integers(min_value=-5, max_value=2**64), max_size=4), ANY),
}
COMPLETION = st.fixed_dictionaries(
    {"prompt": st.one_of(STRINGS, st.lists(st.integers(min_value=-1, max_value=400), max_size=6), ANY)},
    optional={**COMMON, "logprobs": ANY, "echo": ANY, "best_of": ANY, "suffix": ANY},
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool", "developer"]), ANY)},
    optional={"content": st.one_of(STRINGS, st.lists(st.fixed_dictionaries({"type": ANY, "text": ANY})), ANY)},
)
CHAT = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), ANY)},
    optional={
        **COMMON,
        "max_completion_tokens": ANY,
        "logprobs": ANY,
        "top_logprobs": ANY,
        "tools": ANY,
        "response_format": ANY,
        "add_generation_prompt": ANY,
    },
)


class Bystander:
    """Repeats WELL_FORMED in a thread; records every answer that differs from the reference."""

    def __init__(self, url: str, reference: str) -> None:
        self.url, self.reference = url, reference
        self.runs, self.problems = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self._stop.is_set():
                r = client.post("/v1/completions", json=WELL_FORMED)
                self.runs += 1
                if r.status_code != 200 or r.json()["choices"][0]["text"] != self.reference:
                    self.problems.append((r.status_code, r.text[:300]))

    def __enter__(self) -> Bystander:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


@pytest.fixture(scope="module")
def fuzz_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Bystander]]:
    model = add_chat_template(make_model(tmp_path_factory.mktemp("fuzz")))
    with running_server(model, max_model_len=64, num_kv_blocks=24, block_size=8, max_num_seqs=8) as srv:
        reference = httpx.post(f"{srv.url}/v1/completions", json=WELL_FORMED, timeout=60).json()["choices"][0]["text"]
        with Bystander(srv.url, reference) as bystander:
            yield srv, bystander
        assert bystander.runs > 0 and bystander.problems == [], bystander.problems[:3]
        srv.wait_idle()
        srv.llm.block_manager.check_no_leaks()


def check_answer(srv: RunningServer, path: str, body: dict[str, Any]) -> None:
    """POST `body` (NaN/Infinity as JSON literals); the answer must be 2xx or a well-formed 4xx."""
    raw = json.dumps(body, allow_nan=True)
    with httpx.stream(
        "POST", f"{srv.url}{path}", content=raw, headers={"Content-Type": "application/json"}, timeout=60
    ) as r:
        text = r.read().decode()
    assert r.status_code < 500, (r.status_code, text[:500], raw[:500])
    if r.status_code >= 400:
        err = json.loads(text)["error"]
        assert err["message"] and err["type"] == "invalid_request_error", err
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert '"server_error"' not in text and text.rstrip().endswith("data: [DONE]"), text[-500:]
    else:
        assert json.loads(text)["choices"], text[:500]


FUZZ = settings(
    max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
FUZZ_LONG = settings(FUZZ, max_examples=1500)


@FUZZ
@given(body=COMPLETION)
def test_fuzz_completions(fuzz_srv: tuple[RunningServer, Bystander], body: dict[str, Any]) -> None:
    check_answer(fuzz_srv[0], "/v1/completions", body)


@FUZZ
@given(body=CHAT)
def test_fuzz_chat(fuzz_srv: tuple[RunningServer, Bystander], body: dict[str, Any]) -> None:
    check_answer(fuzz_srv[0], "/v1/chat/completions", body)


@pytest.mark.slow
@FUZZ_LONG
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), data=st.data())
def test_fuzz_long(fuzz_srv: tuple[RunningServer, Bystander], path: str, data: st.DataObject) -> None:
    check_answer(fuzz_srv[0], path, data.draw(COMPLETION if path == "/v1/completions" else CHAT))
