"""Bad requests get OpenAI-style 4xx bodies and the server keeps serving."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.serve.conftest import make_model
from tests.serve.test_api import RunningServer, add_chat_template, running_server

MAX_LEN = 64


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model = add_chat_template(make_model(tmp_path_factory.mktemp("api_err")))
    # 3 blocks of 16 = 48 slots: a request that fits max_model_len can still be too big for the pool
    with running_server(model, max_model_len=MAX_LEN, num_kv_blocks=3, block_size=16) as s:
        yield s


@pytest.fixture(scope="module")
def plain_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A model without a chat template, one running request and a one-slot waiting queue."""
    with running_server(make_model(tmp_path_factory.mktemp("api_plain")), max_num_seqs=1, max_waiting=1) as s:
        yield s


def post(srv: RunningServer, path: str, body: object = None, content: bytes | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    r = httpx.post(f"{srv.url}{path}", json=body, content=content, headers=headers, timeout=60)
    return r.status_code, r.json()


def assert_error(
    status_body: tuple[int, dict], status: int, param: str | None, code: str | None = None, says: str = ""
) -> None:
    status_got, body = status_body
    assert status_got == status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]
    assert code is None or err["code"] == code
    assert says.lower() in err["message"].lower()


CMPL = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("override", "param", "code", "says"),
    [
        ({"temperature": -1}, "temperature", "invalid_value", ">= 0"),
        ({"top_p": 0}, "top_p", "invalid_value", "(0, 1]"),
        ({"top_k": -5}, "top_k", "invalid_value", "top_k"),
        ({"presence_penalty": 3}, "presence_penalty", "invalid_value", "[-2, 2]"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "invalid_value", "[-2, 2]"),
        ({"max_tokens": "many"}, "max_tokens", "invalid_value", "integer"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value", ">= 1"),
        ({"max_tokens": MAX_LEN}, "max_tokens", "context_length_exceeded", "at most"),
        ({"prompt": "hello " * 80}, "prompt", "context_length_exceeded", "shorten the prompt"),
        ({"prompt": "x" * 100_000}, "prompt", "context_length_exceeded", "100000 characters"),
        ({"max_tokens": 50}, "max_tokens", "request_too_large", "KV blocks"),
        ({"n": 2}, "n", "unsupported_parameter", "n=1"),
        ({"echo": True}, "echo", "unsupported_parameter", "echo"),
        ({"best_of": 3}, "best_of", "unsupported_parameter", "best_of"),
        ({"suffix": "end"}, "suffix", "unsupported_parameter", "suffix"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias", "unsupported_parameter", "logit_bias"),
        ({"logprobs": 50}, "logprobs", "invalid_value", "[0, 20]"),
        ({"prompt": ["a", "b"]}, "prompt", "unsupported_parameter", "one request per prompt"),
        ({"prompt": []}, "prompt", "invalid_value", "empty"),
        ({"prompt": [5, 10**6]}, "prompt", "invalid_value", "outside the vocabulary"),
        ({"stop": [""]}, "stop", "invalid_value", "non-empty"),
    ],
)
def test_bad_completion_parameters(srv: RunningServer, override: dict, param: str, code: str, says: str) -> None:
    assert_error(post(srv, "/v1/completions", {**CMPL, **override}), 400, param, code, says)


@pytest.mark.parametrize(
    ("override", "param", "code", "says"),
    [
        (
            {"max_completion_tokens": MAX_LEN},
            "max_completion_tokens",
            "context_length_exceeded",
            "max_completion_tokens",
        ),
        ({"top_logprobs": 2}, "top_logprobs", "invalid_value", "logprobs=true"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "unsupported_parameter", "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter", "json_object"),
        ({"messages": []}, "messages", "invalid_value", "at least 1"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content",
            "unsupported_parameter",
            "text parts",
        ),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "invalid_value", "user"),
    ],
)
def test_bad_chat_parameters(srv: RunningServer, override: dict, param: str, code: str, says: str) -> None:
    assert_error(post(srv, "/v1/chat/completions", {**CHAT, **override}), 400, param, code, says)


def test_malformed_bodies_unknown_model_and_route(srv: RunningServer) -> None:
    assert_error(post(srv, "/v1/completions", content=b'{"prompt": "x",'), 400, None, "invalid_json", "not valid JSON")
    assert_error(post(srv, "/v1/chat/completions", content=b"[1, 2]"), 400, None, "invalid_json", "JSON object")
    assert_error(post(srv, "/v1/completions", {"max_tokens": 3}), 400, "prompt", "invalid_value")
    assert_error(post(srv, "/v1/completions", {**CMPL, "model": "gpt-9"}), 404, "model", "model_not_found", "gpt-9")
    with pytest.raises(openai.NotFoundError) as info:
        srv.client().chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "model_not_found"
    r = httpx.get(f"{srv.url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "http_404"
    r = httpx.get(f"{srv.url}/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    # after all of that the server still answers
    ok = srv.client().completions.create(
        model="tiny", prompt="hello", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert ok.usage.completion_tokens == 3
    srv.wait_idle()
    srv.llm.block_manager.check_no_leaks()


def test_model_without_chat_template_says_what_to_do(plain_srv: RunningServer) -> None:
    status, body = post(plain_srv, "/v1/chat/completions", CHAT)
    assert_error((status, body), 400, "messages", "chat_template_missing", "no chat template")
    assert "/v1/completions" in body["error"]["message"]
    assert plain_srv.client().completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_full_queue_answers_429_and_serves_the_rest(plain_srv: RunningServer) -> None:
    body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 120, "temperature": 0, "ignore_eos": True}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=plain_srv.url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(6)))

    responses = asyncio.run(run())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
    for r in responses:
        if r.status_code == 429:
            err = r.json()["error"]
            assert err["code"] == "queue_full" and "max_waiting=1" in err["message"] and "retry later" in err["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 120
    plain_srv.wait_idle()
    assert plain_srv.metrics()["warsha_request_rejected_total"] == codes.count(429)
    plain_srv.llm.block_manager.check_no_leaks()
