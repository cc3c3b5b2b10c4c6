"""OpenAI request models, their validation into `SamplingParams`, and the error body.

Unknown fields are ignored (clients send fields like `user` or `metadata` freely), but fields
we know and do not implement are refused when set to anything but their no-op value, so a
client never silently gets different behaviour from what it asked for.

Every field is checked for type, range and finiteness here, before anything reaches the engine
(one malformed value in a batched step would otherwise fail every request in the batch): NaN
and infinities are refused, `seed` must fit 0..2**63-1, stop lists are bounded, and strings must
be valid Unicode (a lone surrogate such as "\\ud800" cannot be encoded to UTF-8). Each error
names the offending field in `param`, as OpenAI's API does.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from serve.sampler import MAX_SEED, SamplingParams

log = logging.getLogger("serve.api")
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256  # characters; also bounds how much text the engine re-checks per token
MAX_STOP_TOKEN_IDS = 256
MAX_JSON_DEPTH = 32
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, type_: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or {404: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        """The OpenAI error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    """`stream_options`: only include_usage is meaningful here."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM, SGLang)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # extension: benchmarks need fixed-length outputs
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)  # extension

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        items = [stop] if isinstance(stop, str) else stop or []
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(items)}")
        longest = max((len(s) for s in items), default=0)
        if longest > MAX_STOP_LENGTH:
            raise ValueError(f"a stop string may have at most {MAX_STOP_LENGTH} characters, got {longest}")
        return stop


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    """One message; content may be a string or a list of text parts."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # extension


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Parse and validate a JSON body; ApiError (400) naming the field on any problem.

    Runs in a worker thread (it is CPU work proportional to the body), never on the event loop.
    """
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, int digit limit
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    check_strings(data)
    known = set(model.model_fields)
    ignored = sorted(k for k in data if k not in known)
    if ignored:
        log.warning("ignoring unknown request fields: %s", ", ".join(ignored[:20]))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = field_path(first["loc"])
        shown = repr(first.get("input"))
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        raise ApiError(400, f"{param}: {first['msg']} (got {shown})", param=param, code="invalid_value") from exc


def field_path(loc: tuple[Any, ...]) -> str | None:
    """`messages.0.role` from a pydantic error location, without its union-member tags (`str`, `list[int]`)."""
    parts = [
        str(p)
        for p in loc
        if isinstance(p, int) or (isinstance(p, str) and p.isidentifier() and p.lower() not in _TYPE_TAGS)
    ]
    return ".".join(parts) or None


def check_strings(data: Any) -> None:
    """400 for nesting deeper than MAX_JSON_DEPTH and for strings that are not valid Unicode.

    JSON's `\\ud800` escapes decode to lone surrogates, which Python keeps but no tokenizer or
    UTF-8 encoder accepts; the error names the field holding one.
    """
    stack: list[tuple[Any, tuple[Any, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            raise ApiError(
                400,
                f"the request nests deeper than {MAX_JSON_DEPTH} levels",
                param=field_path(path[:2]),
                code="invalid_value",
            )
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path)
                stack.append((item, (*path, key)))
        elif isinstance(value, list):
            stack.extend((item, (*path, i)) for i, item in enumerate(value))
        else:
            _check_text(value, path)


def _check_text(value: Any, path: tuple[Any, ...]) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            param = ".".join(str(p) for p in path) or None
            raise ApiError(
                400,
                f"{param}: the text holds a lone surrogate ({value[exc.start]!r} at character {exc.start}), which "
                "is not valid Unicode; send UTF-8 text",
                param=param,
                code="invalid_value",
            ) from exc


def refuse_unsupported(req: _Common, extra: dict[str, Any]) -> None:
    """400 for known parameters set to values this server does not implement."""
    checks = dict(extra)
    checks["n"] = (req.n != 1, "only n=1 is supported; send n separate requests")
    checks["logit_bias"] = (bool(req.logit_bias), "logit_bias is not supported")
    for param, (bad, message) in checks.items():
        if bad:
            raise ApiError(400, message, param=param, code="unsupported_parameter")


def sampling_params(req: _Common, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """Build SamplingParams; its ValueError becomes a 400 naming the parameter."""
    kwargs: dict[str, Any] = dict(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        max_tokens=max_tokens,
        seed=req.seed,
        stop=req.stop or None,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
    )
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        match = re.match(r"(\w+)", str(exc))
        param = match.group(1) if match and match.group(1) in kwargs else None
        raise ApiError(400, str(exc), param=param, code="invalid_value") from exc


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, param: str) -> int:
    """max_tokens defaulting to the rest of the context; 400 when prompt + max_tokens do not fit."""
    if prompt_len >= max_model_len:
        raise ApiError(
            400,
            f"the prompt has {prompt_len} tokens but this server's context is {max_model_len} tokens, leaving no room "
            "to generate; shorten the prompt",
            param="messages" if param == "max_completion_tokens" else "prompt",
            code="context_length_exceeded",
        )
    if requested is None:
        return max_model_len - prompt_len
    if requested < 1:
        raise ApiError(400, f"{param} must be >= 1, got {requested}", param=param, code="invalid_value")
    if prompt_len + requested > max_model_len:
        raise ApiError(
            400,
            f"prompt ({prompt_len} tokens) + {param} ({requested}) = {prompt_len + requested} tokens exceeds this "
            f"server's context of {max_model_len} tokens; lower {param} to at most {max_model_len - prompt_len}",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as plain dicts for the template; text parts are joined, other parts refused."""
    out = []
    for i, msg in enumerate(req.messages):
        data = msg.model_dump(exclude_none=True)
        if isinstance(msg.content, list):
            texts = []
            for part in msg.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(
                        400,
                        f"messages[{i}].content: only text parts are supported, got type {part.get('type')!r}",
                        param=f"messages.{i}.content",
                        code="unsupported_parameter",
                    )
                texts.append(part["text"])
            data["content"] = "\n".join(texts)
        data.setdefault("content", "")
        out.append(data)
    return out
