"""The OpenAI-compatible server, driven over real HTTP by the `openai` client.

A uvicorn server runs in a thread on a free 127.0.0.1 port; answers are compared with the
engine's offline `LLM.generate` on the same model and with transformers' chat templating.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from serve import LLM, SamplingParams, cpu_kernels
from tests.serve.conftest import make_model

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYS] {{ m['content'] }}\n"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
NUM_KV_BLOCKS = 40  # 16-token blocks: about 20 sequences of ~30 tokens


@dataclass
class RunningServer:
    """A live server: its URL and the engine behind it (inspected only while it is idle)."""

    url: str
    llm: LLM
    server: object

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        return parse_prometheus(httpx.get(f"{self.url}/metrics").text)

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Wait until the engine holds no request and every KV block is free again."""
        deadline = time.monotonic() + timeout
        bm = self.llm.block_manager
        while time.monotonic() < deadline:
            m = self.metrics()
            if (
                m["warsha_num_requests_running"] == 0
                and m["warsha_num_requests_waiting"] == 0
                and bm.num_free_blocks == bm.num_blocks
            ):
                return
            time.sleep(0.02)
        raise AssertionError(f"engine not idle after {timeout}s: free {bm.num_free_blocks}/{bm.num_blocks}")


def add_chat_template(model_dir: Path) -> Path:
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    return model_dir


@contextlib.contextmanager
def running_server(
    model_dir: Path, name: str = "tiny", options: object = None, **llm_kwargs: object
) -> Iterator[RunningServer]:
    """Start build_app + uvicorn in a thread on a free port; stop it on exit."""
    import uvicorn

    from serve.api import build_app

    llm = LLM(model_dir, dtype="float32", **llm_kwargs)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(llm, name, model_dir, options), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", llm, server)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples keyed by name plus sorted labels except model_name; checks TYPE lines precede samples."""
    out: dict[str, float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        name, labels, value = m.groups()
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in typed or family in typed, f"{name} has no # TYPE line"
        pairs = sorted(p for p in re.findall(r'(\w+)="([^"]*)"', labels or "") if p[0] != "model_name")
        key = name + ("{" + ",".join(f"{k}={v}" for k, v in pairs) + "}" if pairs else "")
        out[key] = float(value)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_chat_template(make_model(tmp_path_factory.mktemp("api_model")))


@pytest.fixture(scope="module")
def srv(model_dir: Path) -> Iterator[RunningServer]:
    with running_server(model_dir, num_kv_blocks=NUM_KV_BLOCKS, block_size=16, max_num_seqs=64) as s:
        yield s


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> LLM:
    """An independent engine on the same weights: the reference for greedy outputs."""
    return LLM(model_dir, dtype="float32")


def hf_chat_ids(model_dir: Path, messages: list[dict[str, str]]) -> list[int]:
    """Prompt ids as transformers renders and tokenises the same template (the reference)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def stream_text(stream: Iterator, chat: bool) -> tuple[str, list, object]:
    """Concatenated text, finish reasons and the usage of the final chunk."""
    text, reasons, usage = "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if chat else choice.text
            text += piece or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return text, reasons, usage


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def test_completion_greedy_matches_generate_streamed_or_not(srv: RunningServer, offline: LLM) -> None:
    client = srv.client()
    for prompt in ("the quick brown fox", [1, 40, 41, 42, 43, 44]):
        ref = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, **GREEDY)
        assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 24)
        assert r.usage.total_tokens == len(ref.prompt_token_ids) + 24
        stream = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
        text, reasons, usage = stream_text(stream, chat=False)
        assert text == ref.text and reasons == ["length"]
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_token_ids), 24)


def test_chat_uses_the_model_template_and_matches_generate(srv: RunningServer, offline: LLM, model_dir: Path) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "مرحبا بالعالم"}]
    ids = hf_chat_ids(model_dir, messages)
    ref = offline.generate(ids, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    client = srv.client()
    r = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=20, **GREEDY)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 20)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text, reasons, usage = stream_text(iter(chunks), chat=True)
    assert text == ref.text and reasons == ["length"] and usage.prompt_tokens == len(ids)
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])


def test_stop_string_cut_identically_when_streaming(srv: RunningServer, offline: LLM) -> None:
    base = offline.generate("serving engines", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].text
    stop = next(
        base[i : i + 3]
        for i in range(len(base) // 3, len(base) - 3)
        if "\ufffd" not in base[i : i + 3] and base[i : i + 3].strip()
    )
    ref = offline.generate(
        "serving engines", SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True)
    )[0]
    assert ref.finish_reason == "stop" and stop not in ref.text
    client = srv.client()
    r = client.completions.create(
        model="tiny", prompt="serving engines", max_tokens=30, stop=[stop, "@@never@@"], **GREEDY
    )
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "stop"
    text, reasons, _ = stream_text(
        client.completions.create(
            model="tiny", prompt="serving engines", max_tokens=30, stop=stop, stream=True, **GREEDY
        ),
        chat=False,
    )
    assert text == ref.text and reasons == ["stop"]


def test_logprobs_and_seeded_sampling(srv: RunningServer, offline: LLM) -> None:
    ref = offline.generate([1, 50, 60, 70], SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    client = srv.client()
    r = client.completions.create(model="tiny", prompt=[1, 50, 60, 70], max_tokens=6, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for got, ref_entry, tok in zip(lp.token_logprobs, ref.logprobs, ref.token_ids):
        assert got == pytest.approx(ref_entry[tok], abs=1e-4)
    assert all(
        len(top) <= 3 and max(top.values()) >= got - 1e-6 for top, got in zip(lp.top_logprobs, lp.token_logprobs)
    )
    c = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(
        len(e.top_logprobs) == 2 and e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in content
    )
    sampled = [
        client.completions.create(
            model="tiny",
            prompt="hello",
            max_tokens=12,
            temperature=1.0,
            seed=7,
            extra_body={"ignore_eos": True, "top_k": 40},
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


def test_models_health_and_metrics(srv: RunningServer) -> None:
    client = srv.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{srv.url}/health").status_code == 200
    before = srv.metrics()
    client.completions.create(model="tiny", prompt="the lazy dog", max_tokens=5, **GREEDY)
    m = srv.metrics()
    for name in (
        "warsha_num_requests_running",
        "warsha_num_requests_waiting",
        "warsha_kv_cache_usage_ratio",
        "warsha_num_preemptions_total",
        "warsha_spec_decode_acceptance_rate",
        "warsha_generation_tokens_total",
        "warsha_head_screen_rows_total",  # 0 on this small head; counted in test_head_screen
        "warsha_head_screen_candidates_total",
    ):
        assert name in m, name
    assert (
        m["warsha_request_success_total{finished_reason=length}"]
        == before["warsha_request_success_total{finished_reason=length}"] + 1
    )
    assert m["warsha_generation_tokens_total"] - before["warsha_generation_tokens_total"] == 5
    assert m[f"warsha_cpu_isa_info{{isa={cpu_kernels.isa()}}}"] == 1  # the variant the kernels run
    for hist in ("warsha_time_to_first_token_seconds", "warsha_time_per_output_token_seconds"):
        buckets = sorted(
            ((float(k.split("le=")[1].rstrip("}")), v) for k, v in m.items() if k.startswith(f"{hist}_bucket"))
        )
        assert len(buckets) > 5 and buckets[-1][0] == float("inf")
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
        assert buckets[-1][1] == m[f"{hist}_count"] >= 1 and m[f"{hist}_sum"] > 0
        assert m[f"{hist}_count"] == before[f"{hist}_count"] + 1


def test_200_concurrent_requests_none_lost_no_leak(srv: RunningServer, offline: LLM) -> None:
    prompts = [f"request {i}: the quick brown fox" for i in range(200)]
    lengths = [4 + i % 9 for i in range(200)]
    refs = offline.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths])
    before = srv.metrics()

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str, int]:
        kwargs = dict(
            model="tiny", prompt=prompts[i], max_tokens=lengths[i], temperature=0, extra_body={"ignore_eos": True}
        )
        if i % 2:
            r = await client.completions.create(**kwargs)
            return r.id, r.choices[0].text, r.usage.completion_tokens
        stream = await client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
        rid, text, n = "", "", -1
        async for chunk in stream:
            rid = chunk.id
            text += "".join(c.text for c in chunk.choices)
            n = chunk.usage.completion_tokens if chunk.usage else n
        return rid, text, n

    async def run_all() -> list[tuple[str, str, int]]:
        async with openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    results = asyncio.run(run_all())
    assert len({rid for rid, _, _ in results}) == 200
    assert [text for _, text, _ in results] == [r.text for r in refs]
    assert [n for _, _, n in results] == lengths
    srv.wait_idle()
    srv.llm.block_manager.check_no_leaks()
    after = srv.metrics()
    assert (
        after["warsha_request_success_total{finished_reason=length}"]
        - before["warsha_request_success_total{finished_reason=length}"]
        == 200
    )
    assert after["warsha_kv_cache_free_blocks"] == NUM_KV_BLOCKS
    assert srv.llm.stats.kv_usage_peak > 0.9  # the pool, not max_num_seqs, limited concurrency


def _abort_count(srv: RunningServer) -> float:
    return srv.metrics()["warsha_request_success_total{finished_reason=abort}"]


def _wait_for(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_stream_disconnect_aborts_and_frees_blocks(srv: RunningServer) -> None:
    srv.wait_idle()
    aborted, generated = _abort_count(srv), srv.metrics()["warsha_generation_tokens_total"]
    stream = srv.client().completions.create(model="tiny", prompt="the quick", max_tokens=480, stream=True, **GREEDY)
    for _, _chunk in zip(range(3), stream):
        pass
    stream.close()
    srv.wait_idle()
    assert _abort_count(srv) == aborted + 1
    assert srv.metrics()["warsha_generation_tokens_total"] - generated < 480
    srv.llm.block_manager.check_no_leaks()


def test_non_streaming_disconnect_aborts(srv: RunningServer) -> None:
    srv.wait_idle()
    aborted = _abort_count(srv)
    body = json.dumps(
        {"model": "tiny", "prompt": "the quick", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    ).encode()
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        _wait_for(lambda: srv.metrics()["warsha_num_requests_running"] == 1, "the request to run")
    srv.wait_idle()
    assert _abort_count(srv) == aborted + 1
    srv.llm.block_manager.check_no_leaks()


def test_speculative_server_same_text_and_reports_acceptance(spec_pair: tuple[Path, Path]) -> None:
    target, draft = spec_pair
    prompts = ["the quick brown fox", "paged attention keeps"]
    plain = LLM(target, dtype="float32").generate(
        prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )
    with running_server(target, draft_dir=draft, num_speculative_tokens=3, adaptive_speculation=False) as s:
        client = s.client()
        for prompt, ref in zip(prompts, plain):
            text, _, usage = stream_text(
                client.completions.create(
                    model="tiny",
                    prompt=prompt,
                    max_tokens=20,
                    stream=True,
                    stream_options={"include_usage": True},
                    **GREEDY,
                ),
                chat=False,
            )
            assert text == ref.text and usage.completion_tokens == 20
        m = s.metrics()
        assert m["warsha_spec_decode_num_draft_tokens_total"] > 0
        rate = m["warsha_spec_decode_num_accepted_tokens_total"] / m["warsha_spec_decode_num_draft_tokens_total"]
        assert m["warsha_spec_decode_acceptance_rate"] == pytest.approx(rate) and rate > 0.5
