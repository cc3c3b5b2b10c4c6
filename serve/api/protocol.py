"""OpenAI request models, their validation into `SamplingParams`, and the error body.

Unknown fields are ignored (clients send fields like `user` or `metadata` freely), but fields
we know and do not implement are refused when set to anything but their no-op value, so a
client never silently gets different behaviour from what it asked for.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from serve.sampler import SamplingParams

log = logging.getLogger("serve.api")


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

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM, SGLang)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # extension: benchmarks need fixed-length outputs
    stop_token_ids: list[int] | None = None  # extension


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

    model_config = ConfigDict(extra="allow")
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
    """Parse and validate a JSON body; ApiError (400) naming the field on any problem."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    known = set(model.model_fields)
    ignored = sorted(k for k in data if k not in known)
    if ignored:
        log.warning("ignoring unknown request fields: %s", ", ".join(ignored))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(
            400, f"{param}: {first['msg']} (got {first.get('input')!r})", param=param, code="invalid_value"
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
