"""Issue 20's table, one test per row: a hostile request gets a 4xx naming its field, and the
request next to it completes exactly as it would alone. Plus the isolation guarantees: a
request the engine fails on alone, a dying engine thread, the per-request deadline."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from serve import LLM, SamplingParams
from serve.api.guard import ServerOptions
from tests.serve.conftest import make_model
from tests.serve.test_api import RunningServer, add_chat_template, running_server

JSON = {"Content-Type": "application/json"}
LONG = {"model": "tiny", "prompt": "hi", "max_tokens": 300, "ignore_eos": True, "temperature": 0}
POISON_SEED = 4242  # the fault-injecting sampler below fails any batch holding a request with this seed


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_chat_template(make_model(tmp_path_factory.mktemp("hostile")))


@pytest.fixture(scope="module")
def srv(model: Path) -> Iterator[RunningServer]:
    with running_server(model, max_model_len=512, num_kv_blocks=64, options=ServerOptions(max_request_bytes=4096)) as s:
        yield s


@pytest.fixture(scope="module")
def alone(model: Path) -> dict[str, list[int]]:
    """Greedy token ids of LONG run alone in an offline engine (the reference)."""
    llm = LLM(model, dtype="float32", max_model_len=512)
    out = llm.generate("hi", SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))[0]
    return {"long": out.token_ids}


def raw(srv: RunningServer, body: str | bytes, path: str = "/v1/completions", **headers: str) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", content=body, headers={**JSON, **headers}, timeout=120)


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    return r.json()["error"]


async def long_alongside(srv: RunningServer, hostile: dict[str, Any]) -> tuple[httpx.Response, httpx.Response]:
    """Start LONG, send `hostile` while it runs; both responses."""
    async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
        long = asyncio.ensure_future(client.post("/v1/completions", json=LONG))
        while srv.metrics()["warsha_num_requests_running"] < 1:
            await asyncio.sleep(0.01)
        bad = await client.post("/v1/completions", json=hostile)
        return await long, bad


def test_row1_top_k_overflow_does_not_hurt_the_request_in_flight(srv: RunningServer, alone: dict) -> None:
    long, bad = asyncio.run(long_alongside(srv, {"prompt": "x", "max_tokens": 4, "top_k": 9223372036854775808}))
    assert error_of(bad, 400)["param"] == "top_k"
    assert long.status_code == 200 and long.json()["usage"]["completion_tokens"] == 300
    assert long.json()["choices"][0]["text"] == srv.llm.tokenizer.decode(alone["long"])
    srv.wait_idle()
    srv.llm.block_manager.check_no_leaks()


def test_top_k_beyond_the_vocabulary_is_refused(srv: RunningServer) -> None:
    vocab = srv.llm.config.vocab_size
    err = error_of(raw(srv, json.dumps({"prompt": "x", "max_tokens": 2, "top_k": vocab + 1})), 400)
    assert err["param"] == "top_k" and str(vocab) in err["message"]
    assert raw(srv, json.dumps({"prompt": "x", "max_tokens": 2, "top_k": vocab})).status_code == 200


def test_row2_refused_stream_leaves_nothing_in_the_engine(srv: RunningServer) -> None:
    body = {"prompt": "x", "max_tokens": 4, "stream": True, "seed": 18446744073709551616, "top_k": 9223372036854775808}
    err = error_of(raw(srv, json.dumps(body)), 400)
    assert err["param"] in ("seed", "top_k")
    srv.wait_idle()
    assert srv.llm.scheduler.running == [] and not srv.llm.scheduler.waiting
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
    assert (
        raw(srv, json.dumps({"prompt": "x", "max_tokens": 3, "ignore_eos": True})).json()["usage"]["completion_tokens"]
        == 3
    )


@pytest.mark.parametrize(
    ("fragment", "param"),
    [
        ('"temperature": NaN', "temperature"),
        ('"temperature": Infinity', "temperature"),
        ('"temperature": 1e999', "temperature"),
        ('"repetition_penalty": NaN', "repetition_penalty"),
        ('"top_p": -Infinity', "top_p"),
        ('"presence_penalty": NaN', "presence_penalty"),
        ('"seed": -1', "seed"),
        ('"seed": 9223372036854775808', "seed"),
        ('"top_k": -2', "top_k"),
        ('"stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q"]', "stop"),
        ('"stop": "' + "s" * 300 + '"', "stop"),
        ('"logprobs": 21', "logprobs"),
        ('"max_tokens": 1e999', "max_tokens"),
        ('"max_tokens": 123456789012345678901234567890', "max_tokens"),
    ],
)
def test_row3_non_finite_and_out_of_range_values_name_their_field(
    srv: RunningServer, fragment: str, param: str
) -> None:
    err = error_of(raw(srv, '{"prompt": "x", "max_tokens": 4, ' + fragment + "}"), 400)
    assert err["param"] == param, err


def test_row3_tiny_temperature_is_greedy(srv: RunningServer) -> None:
    base = {"prompt": "the quick", "max_tokens": 8, "ignore_eos": True}
    tiny = raw(srv, json.dumps({**base, "temperature": 1e-40})).json()["choices"][0]["text"]
    greedy = raw(srv, json.dumps({**base, "temperature": 0})).json()["choices"][0]["text"]
    assert tiny == greedy and tiny
    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=1e-4).greedy


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        ("/v1/completions", '{"prompt": ["a\\udfffb"], "max_tokens": 2}', "prompt.0"),
        ("/v1/completions", '{"prompt": "ab", "stop": ["\\ud800"], "max_tokens": 2}', "stop.0"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages.0.content"),
    ],
)
def test_row4_lone_surrogates_are_refused(srv: RunningServer, path: str, body: str, param: str) -> None:
    err = error_of(raw(srv, body, path), 400)
    assert err["param"] == param and "surrogate" in err["message"]


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""])
def test_row5_only_json_bodies_are_accepted(srv: RunningServer, ctype: str) -> None:
    body = json.dumps({"prompt": "x", "max_tokens": 2})
    r = httpx.post(f"{srv.url}/v1/completions", content=body, headers={"Content-Type": ctype}, timeout=60)
    assert error_of(r, 415)["code"] == "unsupported_media_type"
    assert raw(srv, body, **{"Content-Type": "application/json; charset=utf-8"}).status_code == 200


def test_row6_large_bodies_get_413_declared_or_chunked(srv: RunningServer) -> None:
    big = json.dumps({"prompt": "x" * 5000, "max_tokens": 2}).encode()
    assert error_of(raw(srv, big), 413)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    r = httpx.post(f"{srv.url}/v1/completions", content=chunks(), headers=JSON, timeout=60)
    assert error_of(r, 413)["code"] == "request_too_large"
    assert raw(srv, json.dumps({"prompt": "x" * 100, "max_tokens": 2})).status_code == 200


def test_row6_parsing_and_tokenising_run_off_the_event_loop(
    srv: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import serve.api.app as app_module

    on_loop: list[bool] = []
    real = app_module.parse_body

    def spy(raw_body: bytes, model: Any) -> Any:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # no event loop runs in this thread: a worker
            on_loop.append(False)
        return real(raw_body, model)

    monkeypatch.setattr(app_module, "parse_body", spy)
    assert raw(srv, json.dumps({"prompt": "x", "max_tokens": 2})).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert raw(srv, json.dumps(chat), "/v1/chat/completions").status_code == 200
    assert on_loop == [False, False]


def test_row7_api_key(model: Path) -> None:
    key = "s3cret-key"
    options = ServerOptions(api_key=key, public_paths=("/health",))
    with running_server(model, options=options, num_kv_blocks=16) as s:
        body = json.dumps({"prompt": "x", "max_tokens": 2})
        assert error_of(raw(s, body), 401)["code"] == "invalid_api_key"
        assert error_of(raw(s, body, Authorization="Bearer wrong"), 401)["code"] == "invalid_api_key"
        assert error_of(raw(s, body, Authorization=key), 401)["code"] == "invalid_api_key"
        assert raw(s, body, Authorization=f"Bearer {key}").status_code == 200
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert httpx.get(f"{s.url}/metrics").status_code == 401
        assert httpx.get(f"{s.url}/v1/models").status_code == 401
        assert httpx.get(f"{s.url}/metrics", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        ok = s.client()
        ok.api_key = key
        assert ok.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens >= 1


def test_api_key_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from serve.api.cli import build_parser

    monkeypatch.setenv("WARSHA_API_KEY", "from-env")
    args = build_parser().parse_args(["m", "--public-paths", "/health,/metrics"])
    assert args.api_key == "from-env" and args.public_paths == "/health,/metrics"
    assert build_parser().parse_args(["m", "--api-key", "k"]).api_key == "k"
    monkeypatch.delenv("WARSHA_API_KEY")
    assert build_parser().parse_args(["m"]).api_key is None
    with pytest.raises(ValueError, match="max_request_bytes"):
        ServerOptions(max_request_bytes=0)


class PoisonedSampler:
    """Wraps the engine's sampler: any batch holding a request with POISON_SEED raises."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.generator = inner.generator

    def __call__(self, logits: Any, params: list[SamplingParams], *rest: Any) -> Any:
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("injected fault")
        return self.inner(logits, params, *rest)


def test_a_request_that_fails_alone_fails_alone(srv: RunningServer, alone: dict) -> None:
    real = srv.llm.sampler
    srv.llm.sampler = PoisonedSampler(real)
    try:
        long, bad = asyncio.run(long_alongside(srv, {"prompt": "x", "max_tokens": 4, "seed": POISON_SEED}))
    finally:
        srv.llm.sampler = real
    err = error_of(bad, 500)
    assert err["code"] == "engine_error" and "injected fault" in err["message"] and "cmpl-" in err["message"]
    assert long.status_code == 200
    assert long.json()["choices"][0]["text"] == srv.llm.tokenizer.decode(alone["long"])
    srv.wait_idle()
    srv.llm.block_manager.check_no_leaks()
    assert srv.metrics()["warsha_request_success_total{finished_reason=error}"] >= 1


def test_engine_thread_death_fails_every_client_at_once(model: Path) -> None:
    class Boom(BaseException):
        pass

    with running_server(model, num_kv_blocks=32) as s:
        engine = s.server.config.app.state.server.engine  # type: ignore[attr-defined]
        real_step = s.llm.step
        calls = {"n": 0}

        def dying_step() -> Any:
            calls["n"] += 1
            if calls["n"] > 20:
                raise Boom("the engine thread is gone")
            return real_step()

        s.llm.step = dying_step  # type: ignore[method-assign]
        r = httpx.post(f"{s.url}/v1/completions", json={**LONG, "max_tokens": 200}, timeout=60)
        err = error_of(r, 500)
        assert "died" in err["message"]
        health = httpx.get(f"{s.url}/health")
        assert health.status_code == 503 and not engine.alive
        assert error_of(raw(s, json.dumps({"prompt": "x", "max_tokens": 2})), 503)["code"] == "engine_down"
        assert s.llm.scheduler.running == [] and not s.llm.scheduler.waiting


def test_request_deadline_aborts_and_frees(model: Path) -> None:
    import time

    with running_server(model, num_kv_blocks=32, options=ServerOptions(request_timeout=0.3)) as s:
        real_step = s.llm.step

        def slow_step() -> Any:
            time.sleep(0.05)
            return real_step()

        s.llm.step = slow_step  # type: ignore[method-assign]
        err = error_of(httpx.post(f"{s.url}/v1/completions", json={**LONG, "max_tokens": 100}, timeout=60), 504)
        assert err["code"] == "timeout" and "--request-timeout" in err["message"]
        with httpx.stream("POST", f"{s.url}/v1/completions", json={**LONG, "max_tokens": 100, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert '"timeout"' in events[-2] and events[-1] == "data: [DONE]"
        s.wait_idle()
        s.llm.block_manager.check_no_leaks()
