"""Incremental detokenisation and stop-string matching over a growing token list.

Both look only at the new tail of the text: decoding the whole output after every token (and
searching all of it for stop strings) costs O(length) per token, O(length^2) per request,
which a long generation with a stop list turns into the server's bottleneck.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["IncrementalText", "StopMatcher"]


class IncrementalText:
    """Detokenise a growing id list without re-decoding it all each step.

    Decoding a window that starts a few tokens back keeps decoders that strip a leading space
    (SentencePiece's Metaspace) or merge bytes (byte-level BPE) consistent with decoding the
    whole; text ending in U+FFFD is an incomplete UTF-8 sequence and waits for more tokens.
    Stop strings can span tokens, so the last `holdback` characters are kept back until the
    request finishes: the engine cuts its final text at the stop string and nothing past the cut
    may already have been sent.
    """

    def __init__(self, decode: Callable[[list[int]], str], holdback: int) -> None:
        self.decode = decode
        self.holdback = holdback
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.text = ""
        self.sent = 0

    def add(self, new_ids: list[int]) -> None:
        """Extend the decoded text with `new_ids` where they form whole characters."""
        self.ids.extend(new_ids)
        before = self.decode(self.ids[self.prefix : self.read])
        after = self.decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)

    def pending(self) -> str:
        """Whole characters decoded from ids not yet in `text` (those end in an incomplete one)."""
        if self.read == len(self.ids):
            return ""
        before = self.decode(self.ids[self.prefix : self.read])
        return self.decode(self.ids[self.prefix :])[len(before) :].rstrip("\ufffd")

    def next_delta(self, final_text: str | None) -> str:
        """Text not sent yet; `final_text` (the engine's, cut at a stop string) ends the stream."""
        if final_text is not None:
            out, self.sent = final_text[self.sent :], max(self.sent, len(final_text))
            return out
        limit = len(self.text) - self.holdback
        if limit <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : limit], limit
        return out


class StopMatcher:
    """Find the first stop string in a request's output as tokens arrive.

    The text grows through `IncrementalText`; each new token searches only the text that could
    hold a match ending in the new characters: the new characters plus the last
    (longest stop - 1) characters before them. A match wholly inside older text would have
    been found when that text arrived.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str], include_stop: bool) -> None:
        self.text = IncrementalText(decode, holdback=0)
        self.stops = stops
        self.include_stop = include_stop
        self.window = max(len(s) for s in stops) - 1
        self.checked = 0

    def add(self, token: int) -> tuple[str, str] | None:
        """Extend by one token; on a hit, (output text cut at the stop string, the stop string)."""
        self.text.add([token])
        text = self.text.text + self.text.pending()  # a stop may end just before an incomplete character
        start = max(0, self.checked - self.window)
        self.checked = len(text)
        hits = [(pos, s) for s in self.stops if (pos := text.find(s, start)) >= 0]
        if not hits:
            return None
        pos, stop = min(hits)
        return (text[: pos + len(stop)] if self.include_stop else text[:pos]), stop
