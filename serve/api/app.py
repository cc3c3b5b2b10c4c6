"""An OpenAI-compatible HTTP server for Warsha's engine (FastAPI + uvicorn, SSE streaming).

    python -m serve ARTIFACT_DIR [--draft DIR] [--port 8000]     (or: warsha serve ...)

Endpoints: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics. The engine
runs in one background thread (`serve.api.async_engine`); handlers validate, admit, then relay the
engine's deltas. A client that goes away, streaming or not, aborts its request so its KV
blocks return to the pool at once instead of after max_tokens more steps.

Isolation: `RequestGuard` (auth, Content-Type, body size) answers before any handler runs; JSON
parsing, validation, chat-template rendering and tokenisation run in a worker thread so the
event loop (and /health) stays responsive under any body; every request has a deadline
(`ServerOptions.request_timeout`, 504 when it passes) and is aborted in the engine however
its handler ends, so no request is left running without a reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.api.async_engine import AsyncEngine, Delta, EngineError
from serve.api.chat_template import ChatTemplate, ChatTemplateError
from serve.api.formatting import Formatter
from serve.api.guard import RequestGuard, ServerOptions
from serve.api.metrics import render
from serve.api.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    parse_body,
    refuse_unsupported,
    resolve_max_tokens,
    sampling_params,
)
from serve.engine import LLM
from serve.sampler import SamplingParams
from serve.scheduler import AdmissionError

log = logging.getLogger("serve.api")
MAX_LOGPROBS = 20


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that runs `on_close` however the response ends (done, error, disconnect)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _wait_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body was already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Server:
    """The request handlers around one `AsyncEngine`."""

    def __init__(self, llm: LLM, model_name: str, model_dir: str | Path, options: ServerOptions) -> None:
        self.llm = llm
        self.options = options
        self.model_name = model_name
        self.engine = AsyncEngine(llm, model_name)
        self.chat_template = ChatTemplate(model_dir)
        self.created = int(time.time())
        self.max_prompt_chars = self._prompt_char_bound()

    def _prompt_char_bound(self) -> int | None:
        """Characters beyond which a text prompt certainly exceeds the context (None: no tokenizer).

        No token covers more characters than its longest piece, so a prompt longer than
        max_model_len * longest piece cannot fit; the factor 4 leaves room for normalisers that
        shrink text. Refusing such prompts before tokenising saves seconds of CPU per megabyte.
        """
        tok = self.llm.tokenizer
        if tok is None:
            return None
        longest = max((len(tok.id_to_token(i) or "") for i in range(tok.vocab_size)), default=1)
        return 4 * self.llm.max_model_len * max(longest, 1) + 1024

    def _check_text_length(self, chars: int, param: str) -> None:
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise ApiError(
                400,
                f"the prompt has {chars} characters, more than this server's context of {self.llm.max_model_len} "
                "tokens can hold; shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )

    # ----------------------------------------------------------------- validation
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist here; this server serves {self.model_name!r} (see /v1/models)",
                param="model",
                code="model_not_found",
            )

    def _prompt_ids(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(
                    400,
                    f"batched prompts are not supported (got {len(prompt)}); send one request per prompt",
                    param="prompt",
                    code="unsupported_parameter",
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.llm.tokenizer is None:
                raise ApiError(
                    400,
                    "the model has no tokenizer.json, so text prompts cannot be encoded; send token ids",
                    param="prompt",
                )
            self._check_text_length(len(prompt), "prompt")
            ids = self.llm.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ApiError(400, "the prompt is empty; give at least one token", param="prompt", code="invalid_value")
        vocab = self.llm.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(
                400,
                f"prompt token id {bad} is outside the vocabulary [0, {vocab})",
                param="prompt",
                code="invalid_value",
            )
        return ids

    # ----------------------------------------------------------------- endpoints
    async def completions(self, request: Request) -> Response:
        ids, params, req = await run_in_threadpool(self._prepare_completion, await request.body())
        return await self._generate(request, "cmpl", False, ids, params, req)

    async def chat_completions(self, request: Request) -> Response:
        ids, params, req = await run_in_threadpool(self._prepare_chat, await request.body())
        return await self._generate(request, "chatcmpl", True, ids, params, req)

    def _prepare_completion(self, raw: bytes) -> tuple[list[int], SamplingParams, CompletionRequest]:
        """Parse, validate and tokenise a completion request (in a worker thread)."""
        req: CompletionRequest = parse_body(raw, CompletionRequest)
        self._check_model(req.model)
        refuse_unsupported(
            req,
            {
                "echo": (req.echo, "echo is not supported; the prompt is not returned with the completion"),
                "best_of": (req.best_of not in (None, 1), "best_of > 1 is not supported"),
                "suffix": (bool(req.suffix), "suffix (insertion) is not supported"),
            },
        )
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise ApiError(
                400,
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}",
                param="logprobs",
                code="invalid_value",
            )
        ids = self._prompt_ids(req.prompt)
        max_tokens = resolve_max_tokens(req.max_tokens, len(ids), self.llm.max_model_len, "max_tokens")
        return ids, self._checked(sampling_params(req, max_tokens, req.logprobs)), req

    def _prepare_chat(self, raw: bytes) -> tuple[list[int], SamplingParams, ChatCompletionRequest]:
        """Parse, validate, render and tokenise a chat request (in a worker thread)."""
        req: ChatCompletionRequest = parse_body(raw, ChatCompletionRequest)
        self._check_model(req.model)
        fmt = (req.response_format or {}).get("type", "text")
        refuse_unsupported(
            req,
            {
                "tools": (bool(req.tools), "tools (function calling) are not supported"),
                "tool_choice": (req.tool_choice not in (None, "none"), "tool_choice is not supported"),
                "response_format": (fmt != "text", f"response_format type {fmt!r} is not supported; only 'text' is"),
            },
        )
        if req.top_logprobs is not None and not (req.logprobs and 0 <= req.top_logprobs <= MAX_LOGPROBS):
            raise ApiError(
                400,
                f"top_logprobs needs logprobs=true and must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                param="top_logprobs",
                code="invalid_value",
            )
        messages = chat_messages(req)
        self._check_text_length(sum(len(str(m.get("content", ""))) for m in messages), "messages")
        try:
            ids = self.chat_template.encode(messages, req.add_generation_prompt)
        except ChatTemplateError as exc:
            raise ApiError(
                400,
                str(exc),
                param="messages",
                code="chat_template_missing" if not self.chat_template.available else "invalid_value",
            ) from exc
        if not ids:
            raise ApiError(400, "the chat template rendered an empty prompt", param="messages", code="invalid_value")
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = resolve_max_tokens(requested, len(ids), self.llm.max_model_len, name)
        params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        return ids, self._checked(params), req

    def _checked(self, params: SamplingParams) -> SamplingParams:
        """The checks that need the model: top_k within the vocabulary."""
        vocab = self.llm.config.vocab_size
        if params.top_k > vocab:
            raise ApiError(
                400,
                f"top_k must be -1 (disabled) or in [1, {vocab}] (the vocabulary size), got {params.top_k}",
                param="top_k",
                code="invalid_value",
            )
        return params

    def models(self) -> dict[str, Any]:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "warsha",
            "max_model_len": self.llm.max_model_len,
        }
        return {"object": "list", "data": [card]}

    def health(self) -> JSONResponse:
        if not self.engine.alive:
            return JSONResponse(
                ApiError(503, "the engine thread is not running", code="engine_down").body(), status_code=503
            )
        return JSONResponse({"status": "ok"})

    # ----------------------------------------------------------------- generation
    async def _admit(self, rid: str, ids: list[int], params: SamplingParams) -> asyncio.Queue:
        try:
            return await self.engine.add(rid, ids, params)
        except AdmissionError as exc:
            if exc.retryable:
                raise ApiError(429, f"the server is busy: {exc}", code="queue_full") from exc
            raise ApiError(400, str(exc), param="max_tokens", code="request_too_large") from exc
        except ValueError as exc:
            first = str(exc).split(" ", 1)[0]
            param = first if first in ("top_k", "seed", "temperature", "top_p", "stop") else "prompt"
            raise ApiError(400, str(exc), param=param, code="invalid_value") from exc
        except EngineError as exc:
            raise ApiError(503, f"request {rid} was not admitted: {exc}", code="engine_down") from exc
        except BaseException:  # cancelled while waiting for admission: never leave it running unread
            self.engine.abort(rid)
            raise

    async def _generate(
        self, request: Request, prefix: str, chat: bool, ids: list[int], params: SamplingParams, req: Any
    ) -> Response:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        top_n = params.logprobs
        decode = self.llm.tokenizer.decode if self.llm.tokenizer is not None else (lambda ids_: "")
        fmt = Formatter(chat, rid, self.model_name, int(time.time()), decode, top_n)
        deadline = asyncio.get_running_loop().time() + self.options.request_timeout
        if req.stream:
            queue = await self._admit(rid, ids, params)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _ClosingStream(self._sse(rid, queue, fmt, include_usage, deadline), lambda: self.engine.abort(rid))
        return await self._unless_disconnected(request, self._collect(rid, ids, params, fmt, deadline))

    async def _collect(
        self, rid: str, ids: list[int], params: SamplingParams, fmt: Formatter, deadline: float
    ) -> Response:
        finished = False
        try:
            queue = await self._admit(rid, ids, params)
            deltas: list[Delta] = []
            while not finished:
                item = await self._next(rid, queue, deadline)
                if isinstance(item, ApiError):
                    raise item
                deltas.append(item)
                finished = item.finished
            return JSONResponse(fmt.response(deltas))
        finally:
            if not finished:
                self.engine.abort(rid)

    async def _next(self, rid: str, queue: asyncio.Queue, deadline: float) -> Delta | ApiError:
        """The request's next delta, or the error that ends it (engine failure, deadline)."""
        try:
            async with asyncio.timeout_at(deadline):
                item = await queue.get()
        except TimeoutError:
            self.engine.abort(rid)
            return ApiError(
                504,
                f"request {rid} did not finish within {self.options.request_timeout:g} s (--request-timeout); "
                "it was aborted",
                code="timeout",
            )
        if isinstance(item, Exception):
            return ApiError(500, f"request {rid} failed: {item}", code="engine_error")
        return item

    async def _sse(
        self, rid: str, queue: asyncio.Queue, fmt: Formatter, include_usage: bool, deadline: float
    ) -> AsyncIterator[str]:
        for chunk in fmt.first_chunks(include_usage):
            yield _event(chunk)
        while True:
            item = await self._next(rid, queue, deadline)
            if isinstance(item, ApiError):
                yield _event(item.body())
                break
            for chunk in fmt.chunks(item, include_usage):
                yield _event(chunk)
            if item.finished:
                if include_usage:
                    yield _event(fmt.usage_chunk(item))
                break
        yield "data: [DONE]\n\n"

    @staticmethod
    async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
        """Run `work`, cancelling it (which aborts the request) if the client disconnects first."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            watcher.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        log.info("client disconnected; request aborted")
        return Response(status_code=499)


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def build_app(llm: LLM, model_name: str, model_dir: str | Path, options: ServerOptions | None = None) -> FastAPI:
    """The ASGI app (FastAPI behind `RequestGuard`); the engine thread starts and stops with its lifespan."""
    options = options or ServerOptions()
    server = Server(llm, model_name, model_dir, options)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine.start(asyncio.get_running_loop())
        yield
        server.engine.stop()

    app = FastAPI(title="Warsha serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            ApiError(exc.status_code, str(exc.detail), code=f"http_{exc.status_code}").body(),
            status_code=exc.status_code,
        )

    @app.exception_handler(Exception)
    async def server_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(ApiError(500, f"internal error: {exc!r}", code="internal_error").body(), status_code=500)

    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route(
        "/metrics",
        lambda: PlainTextResponse(
            render(server.engine.snapshot), media_type="text/plain; version=0.0.4; charset=utf-8"
        ),
        methods=["GET"],
    )
    app.add_middleware(RequestGuard, options=options)
    return app
