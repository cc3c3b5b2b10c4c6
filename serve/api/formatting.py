"""OpenAI response bodies and stream chunks for completions and chat completions.

One `Formatter` per request turns the engine's `Delta`s into JSON-ready dicts, so the
streaming and non-streaming paths share every field and cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from serve.api.async_engine import Delta


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The `usage` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Formatter:
    """Builds the bodies of one request; `chat` selects the chat.completion shapes."""

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        created: int,
        decode: Callable[[list[int]], str],
        top_n: int | None,
    ) -> None:
        self.chat = chat
        self.id = request_id
        self.model = model
        self.created = created
        self.decode = decode
        self.top_n = top_n
        self.text_offset = 0

    # ----------------------------------------------------------------- logprobs
    def _top(self, entry: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(entry.items(), key=lambda kv: -kv[1])[: self.top_n or 0]

    def _top_dict(self, entry: dict[int, float]) -> dict[str, float]:
        """Completions key top logprobs by text; ids decoding to the same text keep the likeliest."""
        out: dict[str, float] = {}
        for i, lp in self._top(entry):
            out.setdefault(self.decode([i]), lp)
        return out

    def _logprobs(self, delta_ids: list[int], entries: list[dict[int, float]]) -> dict[str, Any] | None:
        if self.top_n is None:
            return None
        pairs = list(zip(delta_ids, entries))
        if self.chat:
            return {"content": [self._chat_entry(t, e) for t, e in pairs]}
        tokens = [self.decode([t]) for t, _ in pairs]
        offsets = []
        for tok in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [e[t] for t, e in pairs],
            "top_logprobs": [self._top_dict(e) for _, e in pairs],
            "text_offset": offsets,
        }

    def _chat_entry(self, token: int, entry: dict[int, float]) -> dict[str, Any]:
        def one(i: int, lp: float) -> dict[str, Any]:
            s = self.decode([i])
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        return {**one(token, entry[token]), "top_logprobs": [one(i, lp) for i, lp in self._top(entry)]}

    # ----------------------------------------------------------------- streaming
    def _chunk(self, choice: dict[str, Any], include_usage: bool) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return body

    def first_chunks(self, include_usage: bool) -> list[dict[str, Any]]:
        """Chat streams open with the assistant role, as OpenAI's do."""
        if not self.chat:
            return []
        return [
            self._chunk(
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
                include_usage,
            )
        ]

    def chunks(self, d: Delta, include_usage: bool) -> list[dict[str, Any]]:
        """Stream chunks for one delta (none when it carries no visible change)."""
        lp = self._logprobs(d.token_ids, d.logprobs) if d.logprobs else None
        out = []
        if self.chat:
            if d.text or lp:
                out.append(
                    self._chunk(
                        {"index": 0, "delta": {"content": d.text}, "logprobs": lp, "finish_reason": None}, include_usage
                    )
                )
            if d.finished:
                out.append(
                    self._chunk(
                        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": d.finish_reason}, include_usage
                    )
                )
        elif d.text or lp or d.finished:
            out.append(
                self._chunk(
                    {
                        "index": 0,
                        "text": d.text,
                        "logprobs": lp,
                        "finish_reason": d.finish_reason if d.finished else None,
                    },
                    include_usage,
                )
            )
        return out

    def usage_chunk(self, last: Delta) -> dict[str, Any]:
        """The final `stream_options.include_usage` chunk: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage(last.prompt_tokens, last.completion_tokens),
        }

    # ----------------------------------------------------------------- whole response
    def response(self, deltas: list[Delta]) -> dict[str, Any]:
        """The non-streaming body from every delta of the request."""
        last = deltas[-1]
        text = "".join(d.text for d in deltas)
        ids = [t for d in deltas for t in d.token_ids]
        entries = [e for d in deltas for e in d.logprobs]
        lp = self._logprobs(ids, entries) if self.top_n is not None else None
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": lp,
                "finish_reason": last.finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": last.finish_reason}
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(last.prompt_tokens, last.completion_tokens),
        }
